"""Tiny random Hugging Face checkpoints (transformers + CPU torch) and the transformers logits oracle.

`make_tiny_hf_checkpoint(dir, family, **cfg)` writes config.json + safetensors + a byte-level
tokenizer with a chat template, all offline. Weights are re-drawn with non-trivial scales (norm
weights around 1, non-zero biases) so that every parameter influences the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from corl_jax.demo.tokenizers import build_tokenizer

FAMILIES = ("qwen2", "llama", "qwen3")
_TOKENIZER_STYLE = {"qwen2": "chatml", "qwen3": "chatml", "llama": "llama3"}
_BASE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_tiny_hf_checkpoint(directory, family: str, *, seed: int = 0, max_shard_size: str | None = None,
                            **cfg) -> Path:
    """Save a random `family` model (config overrides in `cfg`, e.g. rope_parameters) to `directory`."""
    directory = Path(directory)
    tokenizer = build_tokenizer(directory, "char", style=_TOKENIZER_STYLE[family])
    settings = {**_BASE, **cfg}
    settings.setdefault("eos_token_id", tokenizer.eos_token_id)
    settings.setdefault("bos_token_id", tokenizer.bos_token_id)
    settings.setdefault("pad_token_id", tokenizer.pad_token_id)
    if len(tokenizer) > settings["vocab_size"]:
        raise ValueError(f"vocab_size {settings['vocab_size']} < tokenizer size {len(tokenizer)}")
    config = transformers.AutoConfig.for_model(family, **settings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


def hf_logits(directory, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """transformers' float32 logits [B, T, V] for a left-padded batch, with explicit position ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager")
    mask = torch.as_tensor(np.asarray(attention_mask, np.int64))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(input_ids, np.int64)), attention_mask=mask,
                    position_ids=positions)
    return out.logits.float().numpy()
