"""Co-RL, 3-agent ring (the paper's N=3 run): Qwen2.5-3B <- Llama-3.2-3B-Instruct <- Qwen3-1.7B-Base <- Qwen2.5-3B.

In-loop evaluation is on MATH-500 (bundled, data source `math500`); the training file still loses its 150-row
holdout, as the reference. Model paths and the dataset are overridable, e.g.
    --config.agents.qwen25.model_path=/ckpt/Qwen2.5-3B --config.data.train_path=/data/math_level345.parquet
Variants: `:tiny` (CI smoke, random tiny models), `:demo` (the embedded CPU demo on the arithmetic world).
"""

from corl_jax.config import agent_config, apply_variant, base_config


def get_config(variant: str = ""):
    c = base_config()
    c.method = "co_rl"
    c.topology = "ring"
    c.agents.qwen25 = agent_config("Qwen/Qwen2.5-3B", "qwen2")
    c.agents.llama32 = agent_config("meta-llama/Llama-3.2-3B-Instruct", "llama")
    c.agents.qwen3 = agent_config("Qwen/Qwen3-1.7B-Base", "qwen3")
    c.data.eval_path = "math500"  # the reference's 3-agent launcher requires MATH500_EVAL_PATH (§2.1, §3.2)
    return apply_variant(c, variant)
