"""Intuitor: one Qwen2.5-1.5B agent rewarded by its self-certainty, mean KL(U || p) (§4.3)."""

from corl_jax.config import apply_variant, baseline_config


def get_config(variant: str = ""):
    return apply_variant(baseline_config("intuitor"), variant)
