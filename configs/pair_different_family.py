"""Co-RL (Different family): Qwen2.5-1.5B and Llama-3.2-1B-Instruct supervise each other."""

from corl_jax.config import agent_config, apply_variant, base_config


def get_config(variant: str = ""):
    c = base_config()
    c.topology = "pair"
    c.agents.qwen25 = agent_config("Qwen/Qwen2.5-1.5B", "qwen2")
    c.agents.llama32 = agent_config("meta-llama/Llama-3.2-1B-Instruct", "llama")
    return apply_variant(c, variant)
