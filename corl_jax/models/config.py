"""`ModelConfig`: the decoder's hyper-parameters, read from and written to HF `config.json`.

One frozen, hashable dataclass describes Qwen2/2.5, Llama-3.x and Qwen3; the families differ only
by flags (`qkv_bias`, `o_bias`, `qk_norm`, `rope_scaling`). `from_hf_dict` accepts the config
dicts written by transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`); `to_hf_dict` writes keys that both read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config omits it
_QWEN3_DEFAULT_HEAD_DIM = 128  # Qwen3Config.head_dim default (not hidden/heads)

# Rematerialisation settings for the training forward: name -> jax.checkpoint policy name.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# Attention of full-sequence forwards (training, scoring): "xla" (einsum, float32 scores; any device), "cudnn"
# (jax.nn.dot_product_attention's fused cuDNN kernel; NVIDIA GPUs, bf16/fp16 compute, head_dim a multiple of 8 up
# to 128), "splash" (Pallas' TPU splash-attention kernel, models/splash_attention.py) or "auto" (see
# `attention_impl`).
TRAIN_ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")


def attention_impl(requested: str, platform: str, dtype, head_dim: int) -> str:
    """The full-sequence attention that runs: `requested` unless "auto", which picks splash on TPUs, cudnn on GPUs
    with bf16/fp16 compute and a head_dim it takes (a multiple of 8 up to 128), else xla."""
    if requested != "auto":
        return requested
    if platform == "tpu":
        return "splash"
    if (platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128):
        return "cudnn"
    return "xla"


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The `llama3` RoPE frequency scaling of Llama-3.1/3.2."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (from `config.json`) plus runtime settings (`param_dtype`, `dtype`, `remat`, `attention`).

    `dtype` is the compute dtype of activations and matmul inputs; RMSNorm statistics, attention
    softmax and logits are always float32. `checkpoint_dtype` is the dtype name recorded in the
    source config (kept for saving).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    param_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    remat: str = "none"
    attention: str = "xla"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.attention not in TRAIN_ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r}; choose one of {TRAIN_ATTENTION_IMPLS}")
        # Canonical numpy dtypes keep the config hashable and comparable.
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    def train_flops(self, seq_len: int, head_positions: int) -> float:
        """Matmul FLOPs of one forward + backward (3x forward) of a sequence of `seq_len` tokens whose last
        `head_positions` go through the unembedding; attention scores and values over the full square."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_token = 2 * self.num_layers * (self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size
                                           * self.intermediate_size)
        attention = 4 * self.num_layers * q * seq_len * seq_len
        return 3.0 * (per_token * seq_len + attention + 2 * self.hidden_size * self.vocab_size * head_positions)

    @property
    def train_attention(self) -> str:
        """The full-sequence attention that runs on the default backend (`attention_impl`)."""
        return attention_impl(self.attention, jax.default_backend(), self.dtype, self.head_dim)

    @classmethod
    def from_hf_dict(cls, hf: dict, *, param_dtype=jnp.float32, dtype=None, remat: str = "none",
                     attention: str = "xla") -> "ModelConfig":
        """Parse an HF `config.json` dict (transformers 4.x or 5.x style). `dtype` defaults to `param_dtype`."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}")
        _reject_unsupported_features(hf)
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or (_QWEN3_DEFAULT_HEAD_DIM if model_type == "qwen3" else hidden // heads)
        attention_bias = bool(hf.get("attention_bias", False))
        rope_theta, rope_scaling = _parse_rope(hf)
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o bias; Llama/Qwen3 use `attention_bias` for all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
            param_dtype=param_dtype,
            dtype=param_dtype if dtype is None else dtype,
            remat=remat,
            attention=attention,
        )

    def to_hf_dict(self) -> dict:
        """An HF `config.json` dict readable by transformers 4.x and 5.x; dtype = `param_dtype`."""
        dtype_name = jnp.dtype(self.param_dtype).name
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        hf = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,  # 4.x
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name,  # 4.x
            "dtype": dtype_name,  # 5.x
        }
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = False
        else:
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        if self.model_type == "qwen3":
            hf["use_sliding_window"] = False
        if self.rope_scaling is not None:
            scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
            hf["rope_scaling"] = scaling  # 4.x
            rope_parameters.update(scaling)
        hf["rope_parameters"] = rope_parameters  # 5.x
        return hf

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] (float32), with `llama3` scaling when configured."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        s = self.rope_scaling
        if s is not None:
            wavelen = 2 * math.pi / inv_freq
            low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
            smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
            is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
            inv_freq = np.where(is_medium, smoothed, scaled)
        return inv_freq.astype(np.float32)


def _reject_unsupported_features(hf: dict) -> None:
    """Fail loudly on config features the decoder does not implement (instead of silently ignoring them)."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']}")
    if problems:
        raise ValueError(f"config.json uses unsupported features: {'; '.join(problems)}")


def _parse_rope(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: 'default', 'llama3'")
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                hf.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or hf["max_position_embeddings"]
            ),
        )
    except KeyError as e:
        raise ValueError(f"llama3 RoPE scaling in config.json lacks {e.args[0]!r}") from None
    return theta, scaling
