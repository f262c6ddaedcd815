"""Issue 22 part 1: the real SmolLM2-135M-Instruct (corl_jax.models.smollm2) trained on symbolic two-step arithmetic.

    python -m corl_jax.train --config=configs/smollm2.py:<variant> --workdir=...

Variants, all on the same world and budget:
- `gt_reward`: GRPO rewarded against the gold answers.
- `ttrl`: rewarded by agreement with its own majority vote.
- `pair_demo`: Co-RL pair, SmolLM2 (Llama architecture) with the `demo:qwen3` base (a Qwen3-style model
  warm-started on this arithmetic world's symbolic problems, so it can read these prompts).
- `pair_same`: the same-family control, SmolLM2 with SmolLM2 (the runs differ only by sampling seeds).

The default world is levels 2, symbolic, numbers up to 20. On the 2-core CPU the base scored 1/16 there
(experiments/results/smollm2/base_accuracy_cpu.json). experiments/evidence/smollm2_sweep.py measures the candidate
worlds first and overrides data.train_path / data.eval_path with its pick. The checkpoint directory must exist
(`smollm2.smollm2_hf_dir()` or `smollm2.unpack_parts`; the sweep makes it).
"""

from corl_jax.config import agent_config, base_config
from corl_jax.data import arithmetic_source
from corl_jax.models.smollm2 import DEFAULT_CACHE_DIR

WORLD = dict(levels=(2,), word_fraction=0.0, max_value=20)
VARIANTS = ("gt_reward", "ttrl", "pair_demo", "pair_same")
PARTNER = "demo:qwen3"


def smollm2_agent(**overrides):
    return agent_config(str(DEFAULT_CACHE_DIR), "llama", **overrides)


def get_config(variant: str = "ttrl"):
    if variant not in VARIANTS:
        raise ValueError(f"unknown smollm2 variant {variant!r}; use one of {VARIANTS} (e.g. configs/smollm2.py:ttrl)")
    c = base_config()
    if variant in ("gt_reward", "ttrl"):
        c.method = variant
        c.agents.smollm2 = smollm2_agent()
    else:
        c.topology = "pair"
        c.agents.smollm2 = smollm2_agent()
        c.agents.partner = (agent_config(PARTNER, "qwen3", compute_dtype="float32", learning_rate=3e-5)
                            if variant == "pair_demo" else smollm2_agent())
    c.data.train_path, c.data.eval_path = arithmetic_source("rl", WORLD), arithmetic_source("test", WORLD)
    c.data.max_eval_samples = 200
    c.mesh.data = 1
    # 8 prompts x 8 samples per step; SmolLM2's chat prompts are ~60 tokens, its solutions here mostly < 150.
    c.rollout.update(prompts_per_step=8, num_generations=8, max_new_tokens=192, max_prompt_len=128)
    # Micro-batches of 8 with remat, so that a dozen runs share one GPU: one micro-batch of 64 without remat held
    # 51.4 GiB of update temporaries (`compile_check --topology=cpu`; 1.8 GiB this way), and 12 runs side by side
    # ran out of memory on an 80 GB H100. Neither changes the update (tests/test_update_oracle.py, test_models.py).
    c.grpo.update(micro_batch_size=8, remat="full")
    # A 135M model at the upper end of GRPO's usual 1e-6..5e-6, so that 30 steps can move it. One eval at the
    # end (besides step 0): every eval that sets a best also saves a 1.6 GB checkpoint.
    c.optim.learning_rate = 5e-6
    c.train.update(max_steps=30, eval_every=30, eval_max_new_tokens=192, eval_batch_prompts=200,
                   eval_samples_per_prompt=2, save_every=30, keep_last=1, log_records=False)
    return c
