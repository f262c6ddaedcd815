"""Models: one NNX decoder for Qwen2/2.5, Llama-3.x and Qwen3, HF checkpoint interchange, sharding.

Public API: `from_pretrained`, `save_pretrained`, `logits`, `Policy`, `ModelConfig`, `Decoder`,
`KVCache`, `positions_from_mask`; sharding helpers live in `corl_jax.models.sharding`.
"""

from corl_jax.models.config import ModelConfig
from corl_jax.models.decoder import Decoder, KVCache, positions_from_mask
from corl_jax.models.hf_io import Policy, from_pretrained, logits, save_pretrained

__all__ = ["Decoder", "KVCache", "ModelConfig", "Policy", "from_pretrained", "logits", "positions_from_mask",
           "save_pretrained"]
