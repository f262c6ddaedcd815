"""RENT: one Qwen2.5-1.5B agent rewarded by minus its mean token entropy (§4.3)."""

from corl_jax.config import apply_variant, baseline_config


def get_config(variant: str = ""):
    return apply_variant(baseline_config("rent"), variant)
