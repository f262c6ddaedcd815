"""corl_jax: label-free multi-agent GRPO (Co-RL) in JAX/Flax NNX.

The package root stays light: import the room you need (`corl_jax.models`,
`corl_jax.sampling`, `corl_jax.answers.math`, `corl_jax.voting`, ...).
"""

__version__ = "0.1.0"
