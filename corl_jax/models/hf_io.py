"""Hugging Face checkpoint directories <-> `Policy` (config + NNX decoder + tokenizer).

One table (`TENSOR_MAP`) maps each decoder parameter to its HF tensor name and layout; one generic
loader reads every parameter straight into its target sharding with
`jax.make_array_from_callback`: each device's callback reads only its slice of the safetensors
file(s) (layer by layer for the stacked [L, ...] parameters), so no process ever holds a full copy
per device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads bf16 tensors)
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from corl_jax.models.config import ModelConfig
from corl_jax.models.decoder import Decoder, positions_from_mask
from corl_jax.models.sharding import DEFAULT_RULES, batch_sharding, variable_sharding

# ------------------------------------------------------------------------------ name/layout table

@dataclasses.dataclass(frozen=True)
class _Layout:
    """How an HF tensor maps to ours, written like einops: "(h k) d -> d h k" reads HF [H*hd, D]
    as ours [D, H, hd]. Only the first name of a parenthesised group may be sliced when reading."""

    hf_groups: tuple[tuple[str, ...], ...]
    ours: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> "_Layout":
        left, right = text.split("->")
        groups = [tuple(g.strip("()").split()) for g in re.findall(r"\([^)]*\)|\S+", left)]
        return cls(tuple(groups), tuple(right.split()))

    def hf_shape(self, our_shape) -> tuple[int, ...]:
        sizes = dict(zip(self.ours, our_shape))
        return tuple(math.prod(sizes[n] for n in g) for g in self.hf_groups)

    def read(self, hf_slice, our_shape, our_index: tuple[slice, ...]) -> np.ndarray:
        """Our block `our_index` of the tensor, reading only the rows it needs from `hf_slice`
        (a safetensors slice): inner names of a group are read whole and sliced afterwards."""
        sizes = dict(zip(self.ours, our_shape))
        wanted = dict(zip(self.ours, our_index))
        hf_index, split_shape, inner_index = [], [], []
        for outer, *inner in self.hf_groups:
            inner_size = math.prod(sizes[n] for n in inner)
            sl = wanted[outer]
            hf_index.append(slice(sl.start * inner_size, sl.stop * inner_size))
            split_shape += [sl.stop - sl.start] + [sizes[n] for n in inner]
            inner_index += [slice(None)] + [wanted[n] for n in inner]
        block = np.asarray(hf_slice[tuple(hf_index)]).reshape(split_shape)[tuple(inner_index)]
        names = [n for g in self.hf_groups for n in g]
        return block.transpose([names.index(n) for n in self.ours])

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        names = [n for g in self.hf_groups for n in g]
        flat = ours.transpose([self.ours.index(n) for n in names])
        return np.ascontiguousarray(flat.reshape(self.hf_shape(ours.shape)))


@dataclasses.dataclass(frozen=True)
class _Tensor:
    path: str  # our parameter path in the NNX state, e.g. "layers.q_proj"
    hf_name: str  # with "{i}" for per-layer tensors, which we stack on a leading layer axis
    layout: _Layout

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name


def _t(path: str, hf_name: str, layout: str) -> _Tensor:
    return _Tensor(path, hf_name, _Layout.parse(layout))


_L = "model.layers.{i}."
TENSOR_MAP: tuple[_Tensor, ...] = (
    _t("embed", "model.embed_tokens.weight", "v d -> v d"),
    _t("final_norm", "model.norm.weight", "d -> d"),
    _t("lm_head", "lm_head.weight", "v d -> d v"),
    _t("layers.attn_norm", _L + "input_layernorm.weight", "d -> d"),
    _t("layers.q_proj", _L + "self_attn.q_proj.weight", "(h k) d -> d h k"),
    _t("layers.k_proj", _L + "self_attn.k_proj.weight", "(h k) d -> d h k"),
    _t("layers.v_proj", _L + "self_attn.v_proj.weight", "(h k) d -> d h k"),
    _t("layers.q_bias", _L + "self_attn.q_proj.bias", "(h k) -> h k"),
    _t("layers.k_bias", _L + "self_attn.k_proj.bias", "(h k) -> h k"),
    _t("layers.v_bias", _L + "self_attn.v_proj.bias", "(h k) -> h k"),
    _t("layers.q_norm", _L + "self_attn.q_norm.weight", "k -> k"),
    _t("layers.k_norm", _L + "self_attn.k_norm.weight", "k -> k"),
    _t("layers.o_proj", _L + "self_attn.o_proj.weight", "d (h k) -> h k d"),
    _t("layers.o_bias", _L + "self_attn.o_proj.bias", "d -> d"),
    _t("layers.mlp_norm", _L + "post_attention_layernorm.weight", "d -> d"),
    _t("layers.gate_proj", _L + "mlp.gate_proj.weight", "f d -> d f"),
    _t("layers.up_proj", _L + "mlp.up_proj.weight", "f d -> d f"),
    _t("layers.down_proj", _L + "mlp.down_proj.weight", "d f -> f d"),
)
_BY_PATH = {t.path: t for t in TENSOR_MAP}


# ------------------------------------------------------------------------------ policy

@dataclasses.dataclass
class Policy:
    """A loaded model: `.config`, `.model` (the NNX `Decoder`), `.tokenizer`, `.mesh` (None: one device),
    `.rules` (logical-axis rules used for the parameters) and the source `generation_config` dict.

    Jitted code uses it functionally: `graphdef, state = nnx.split(policy.model)`."""

    config: ModelConfig
    model: Decoder
    tokenizer: Any
    mesh: Mesh | None = None
    rules: tuple = DEFAULT_RULES
    generation_config: dict = dataclasses.field(default_factory=dict)


def logits(policy: Policy, input_ids, attention_mask) -> jax.Array:
    """float32 logits [B, T, V] of a left-padded batch (ids int [B, T], mask bool [B, T])."""
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.asarray(attention_mask, bool)
    if ids.shape != mask.shape or ids.ndim != 2:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [B, T]")
    if policy.mesh is not None:
        ids, mask = (jax.device_put(x, batch_sharding(x.shape, policy.mesh, policy.rules)) for x in (ids, mask))
    graphdef, state = nnx.split(policy.model)
    return _logits(graphdef, state, ids, mask)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    return model.logits(model(ids, positions_from_mask(mask), mask))


# ------------------------------------------------------------------------------ loading

def from_pretrained(path, *, dtype=jnp.bfloat16, compute_dtype=None, mesh: Mesh | None = None, rules=None,
                    remat: str = "none", attention: str = "xla") -> Policy:
    """Load a local HF checkpoint directory (or a hub id when the hub is reachable).

    dtype: parameter dtype; compute_dtype: activation dtype (default: dtype). With `mesh`, every
    parameter is created directly in its sharding per `rules` (default `DEFAULT_RULES`). `remat` and
    `attention` are the runtime settings of `ModelConfig`.
    """
    directory = _resolve_directory(path)
    hf_config = _read_json(directory / "config.json", "config.json")
    config = ModelConfig.from_hf_dict(hf_config, param_dtype=dtype, dtype=compute_dtype, remat=remat,
                                      attention=attention)
    rules = DEFAULT_RULES if rules is None else rules
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    one_device = SingleDeviceSharding(jax.devices()[0])
    with _Checkpoint(directory) as checkpoint:
        flat = list(nnx.to_flat_state(abstract))
        checkpoint.check(config, flat)
        for path_key, variable in flat:
            sharding = one_device if mesh is None else variable_sharding(variable, mesh, rules)
            variable.set_value(checkpoint.load(_BY_PATH[_path_str(path_key)], variable, sharding))
    model = nnx.merge(graphdef, abstract)
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file, "generation_config.json") if generation_file.is_file() else {}
    from corl_jax.tokenization import load_tokenizer  # transformers is heavy: import only when loading

    return Policy(config=config, model=model, tokenizer=load_tokenizer(directory), mesh=mesh, rules=rules,
                  generation_config=generation)


def _path_str(path_key) -> str:
    return ".".join(str(p) for p in path_key)


def _resolve_directory(path) -> Path:
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if directory.exists():
        raise NotADirectoryError(f"{path} is a file; pass the checkpoint directory that contains config.json")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass a local Hugging Face checkpoint "
                                "directory (config.json, *.safetensors, tokenizer files) or a hub id 'org/name'")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt",
                                                                 "*.model", "*.tiktoken"]))
    except Exception as e:  # any hub failure (offline, unknown repo, auth) gets the same advice
        raise FileNotFoundError(
            f"{path!r} is not a local directory, and downloading it from the Hugging Face hub failed "
            f"(hub unreachable or no such model: {type(e).__name__}: {str(e).splitlines()[0]}). Download the "
            f"checkpoint where the hub is reachable (e.g. `hf download {path} --local-dir DIR`) and pass "
            "the local directory DIR instead.") from e


def _read_json(file: Path, what: str) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent} has no {what}; a Hugging Face checkpoint directory needs "
                                "config.json, model.safetensors (or an index + shards) and tokenizer files")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}); restore the file from the original checkpoint") from None


class _Checkpoint:
    """The safetensors files of a directory, opened lazily; maps tensor names to slices."""

    def __init__(self, directory: Path):
        self.directory = directory
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            self.file_of = {name: directory / f for name, f in
                            _read_json(index_file, index_file.name).get("weight_map", {}).items()}
        elif (directory / "model.safetensors").is_file():
            self.file_of = None  # single file: names come from its header
        else:
            others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            hint = (f" (found {', '.join(others)}: convert PyTorch weights with "
                    "`model.save_pretrained(dir, safe_serialization=True)`)") if others else ""
            raise FileNotFoundError(f"{directory} has no model.safetensors or model.safetensors.index.json{hint}")
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self):
        if self.file_of is None:
            single = self.directory / "model.safetensors"
            self.file_of = {name: single for name in self._open(single).keys()}
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _open(self, file: Path):
        if file not in self._handles:
            if not file.is_file():
                raise FileNotFoundError(f"{file.name} (listed in model.safetensors.index.json) is missing from "
                                        f"{self.directory}; copy all shard files of the checkpoint")
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="np"))
            except SafetensorError as e:
                raise ValueError(f"safetensors file {file} is truncated or corrupt ({e}); re-download or re-save "
                                 "the checkpoint") from None
        return self._handles[file]

    def slice(self, name: str):
        return self._open(self.file_of[name]).get_slice(name)

    def check(self, config: ModelConfig, flat) -> None:
        """Every tensor the model needs is present with the expected shape (headers only)."""
        missing = []
        for path_key, variable in flat:
            tensor = _BY_PATH[_path_str(path_key)]
            per_layer = variable.shape[1:] if tensor.stacked else variable.shape
            names = [tensor.hf_name.format(i=i) for i in range(config.num_layers)] if tensor.stacked \
                else [tensor.hf_name]
            for name in names:
                if name not in self.file_of:
                    missing.append(name)
                    continue
                found = tuple(self.slice(name).get_shape())
                expected = tensor.layout.hf_shape(per_layer)
                if found != expected:
                    raise ValueError(f"tensor {name} in {self.file_of[name].name} has shape {found} but config.json "
                                     f"implies {expected}; the weights do not match the config (wrong config.json "
                                     "or mixed checkpoints)")
        if missing:
            raise ValueError(f"{self.directory} lacks {len(missing)} tensors the {config.model_type} config needs, "
                             f"e.g. {missing[:3]}; the checkpoint is incomplete or config.json is for another model")

    def load(self, tensor: _Tensor, variable, sharding) -> jax.Array:
        """The parameter as a global array in `sharding`; each shard is read from disk by its device's callback."""
        shape, dtype = variable.shape, variable.dtype
        cache: dict[tuple, np.ndarray] = {}  # replicated shards are read once

        def read(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
            key = tuple((s.start, s.stop) for s in index)
            if key not in cache:
                if tensor.stacked:
                    block = np.stack([tensor.layout.read(self.slice(tensor.hf_name.format(i=i)), shape[1:], index[1:])
                                      for i in range(index[0].start, index[0].stop)])
                else:
                    block = tensor.layout.read(self.slice(tensor.hf_name), shape, index)
                cache[key] = block.astype(dtype)
            return cache[key]

        return jax.make_array_from_callback(shape, sharding, read, dtype=dtype)


# ------------------------------------------------------------------------------ saving

def save_pretrained(policy: Policy, directory) -> Path:
    """Write an HF checkpoint directory: config.json, model.safetensors (parameter dtype),
    generation_config.json and the tokenizer files. Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = policy.config
    tensors = {}
    for path_key, variable in nnx.to_flat_state(nnx.state(policy.model, nnx.Param)):
        tensor = _BY_PATH[_path_str(path_key)]
        value = np.asarray(jax.device_get(variable[...]))
        if tensor.stacked:
            for i in range(config.num_layers):
                tensors[tensor.hf_name.format(i=i)] = tensor.layout.to_hf(value[i])
        else:
            tensors[tensor.hf_name] = tensor.layout.to_hf(value)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.to_hf_dict()["eos_token_id"],
                  **policy.generation_config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if policy.tokenizer is not None:
        policy.tokenizer.save_pretrained(str(out))
    return out
