"""Token-in/token-out sampling: `Sampler` (jitted prefill + while_loop decode) and `SamplingParams`.

`controls` turns one step's logits into tokens and logprobs; `engine` runs whole generations;
`text` is the host-side helper from problems to completion texts.
"""

from corl_jax.sampling.controls import SamplingParams, sample_tokens
from corl_jax.sampling.engine import Buckets, Completions, Sampler

__all__ = ["Buckets", "Completions", "Sampler", "SamplingParams", "sample_tokens"]
