"""Co-RL (Same family): two Qwen2.5-1.5B agents supervise each other (reference same_family launcher)."""

from corl_jax.config import agent_config, apply_variant, base_config


def get_config(variant: str = ""):
    c = base_config()
    c.topology = "pair"
    c.agents.qwen_a = agent_config("Qwen/Qwen2.5-1.5B", "qwen2")
    c.agents.qwen_b = agent_config("Qwen/Qwen2.5-1.5B", "qwen2")
    return apply_variant(c, variant)
