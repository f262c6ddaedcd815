"""GT-Reward GRPO: one Qwen2.5-1.5B agent rewarded against the dataset's gold answers (§4.1)."""

from corl_jax.config import apply_variant, baseline_config


def get_config(variant: str = ""):
    return apply_variant(baseline_config("gt_reward"), variant)
