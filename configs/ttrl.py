"""TTRL: one Qwen2.5-1.5B agent rewarded by agreement with its own majority vote (§4.2).

The batch is the reference's TTRL launcher's (§2.1: 8 processes × per-device batch 3 × 64 accumulation steps, G=8):
1536 completions = 192 prompts × 8 per optimiser step, in 64 micro-batches of 24 sequences (3 per device on 8
devices; bnpo's normalisation groups are those 3-sequence batches). Variants (`:tiny`, `:demo`) keep their own small batches.
"""

from corl_jax.config import apply_variant, baseline_config


def get_config(variant: str = ""):
    c = baseline_config("ttrl")
    c.rollout.prompts_per_step = 192
    c.grpo.micro_batch_size = 24
    c.grpo.reference_micro_batch_size = 3  # bnpo normalises per 3-sequence device batch, as the launcher runs
    return apply_variant(c, variant)
