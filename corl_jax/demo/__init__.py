"""The demo world: the synthetic arithmetic problems, its tokenizers, stand-in and warm-started checkpoints.

It builds on the core (corl_jax); the core reaches it only by name, through corl_jax.registry.
"""
