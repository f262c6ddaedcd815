"""TTRL: one Qwen2.5-1.5B agent rewarded by agreement with its own majority vote (§4.2)."""

from corl_jax.config import apply_variant, baseline_config


def get_config(variant: str = ""):
    return apply_variant(baseline_config("ttrl"), variant)
