"""Co-RL (Different family+): the different-family pair, the Llama agent reading rephrased problems (§3.3).

Rows need a `rephrased` field aligned with `text` (same problem, same answer); the arithmetic world provides one.
Its local variants restate each expression in symbols with the operands of + and * swapped: the tiny bases learned
symbolic problems only and cannot read the spoken rephrasings (3% accuracy, experiments/results/demo_sweep/).
"""

from corl_jax.config import agent_config, apply_variant, base_config, variant_sources


def get_config(variant: str = ""):
    c = base_config()
    c.topology = "pair"
    c.agents.qwen25 = agent_config("Qwen/Qwen2.5-1.5B", "qwen2")
    c.agents.llama32 = agent_config("meta-llama/Llama-3.2-1B-Instruct", "llama", text_field="rephrased")
    c.data.train_path = "math_level345_with_rephrased.jsonl"
    c = apply_variant(c, variant)
    if variant:
        c.data.train_path, c.data.eval_path = variant_sources(variant, rephrasing="symbols")
    return c
