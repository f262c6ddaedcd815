"""Built-in stand-in checkpoints for local runs, addressed by model paths `tiny:<family>` (corl_jax.registry).

`tiny:qwen2`, `tiny:llama`, `tiny:qwen3`: randomly initialised two-layer models of each family's architecture
(Qwen2 q/k/v biases and tied embeddings; Llama-3 `llama3` RoPE scaling, GQA 4:1, untied; Qwen3 q/k norms and
head_dim != hidden/heads) with a byte-level tokenizer in the family's chat style. They are ordinary HF checkpoint
directories in the cache (`$CORL_JAX_CACHE`, default ~/.cache/corl_jax), built once, loaded by `from_pretrained`.
The warm-started `demo:<family>` bases (corl_jax.demo.bases) use the same cache helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from corl_jax import registry, stand_ins
from corl_jax.models.paper_shapes import PAPER_MODELS

# HF config.json fields of each family's tiny architecture (vocab_size and token ids come from the tokenizer).
TINY_ARCHITECTURES = {
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=4096),
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=5e5,
                  rms_norm_eps=1e-5, max_position_embeddings=4096,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", hidden_size=48, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
}
CHAT_STYLE = {"qwen2": "chatml", "llama": "llama3", "qwen3": "chatml"}


def cache_root() -> Path:
    """The directory of built checkpoints and other caches: `$CORL_JAX_CACHE`, default ~/.cache/corl_jax."""
    return Path(os.environ.get("CORL_JAX_CACHE", Path.home() / ".cache" / "corl_jax"))


def tiny_checkpoint_dir(family: str) -> Path:
    """The cached random checkpoint of `family` (`tiny:<family>`), built (atomically) on first use."""
    registry.check_family(f"tiny:{family}", family)
    return build_once(cache_root() / "zoo" / f"tiny-{family}", lambda d: build_random_checkpoint(d, family))


def random_shape_dir(model_path: str) -> Path:
    """The cache directory of a `random:<hub id>[@FIELD=N,...]` path (config.json + tokenizer, no weights)."""
    spec = model_path[len("random:"):]
    hub_id, _, options = spec.partition("@")
    if hub_id not in PAPER_MODELS:
        raise ValueError(f"unknown hub id in model path {model_path!r}; use random:<id> with one of "
                         f"{', '.join(PAPER_MODELS)}")
    hf = dict(PAPER_MODELS[hub_id])
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if not isinstance(hf.get(key), int) or isinstance(hf[key], bool) or not value.isdigit() or int(value) < 1:
            sizes = ", ".join(k for k, v in hf.items() if isinstance(v, int) and not isinstance(v, bool))
            raise ValueError(f"bad option {option!r} in model path {model_path!r}; use random:{hub_id}@FIELD=N,... "
                             f"with FIELD one of {sizes}")
        hf[key] = int(value)
    family = hf["model_type"]  # the `tiny:` family names are the model types
    name = "random-" + spec.replace("/", "--").replace("@", "-").replace("=", "").replace(",", "-")

    def build(directory: Path) -> None:
        from corl_jax.demo.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(directory, "char", style=CHAT_STYLE[family])
        hf.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
        (directory / "config.json").write_text(json.dumps(hf, indent=2))
        (directory / stand_ins.MARKER).write_text(json.dumps({"model_path": model_path, "seed": 0}))

    return build_once(cache_root() / "zoo" / name, build)


def is_built(directory: Path) -> bool:
    """Whether `directory` holds a complete built checkpoint (`build_once` renames it into place when done)."""
    return (directory / "config.json").is_file()


def build_once(directory: Path, build) -> Path:
    """Build into a temporary sibling and rename, so a killed build never leaves a half directory."""
    if is_built(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    try:
        build(tmp)
        os.replace(tmp, directory)
    except OSError:
        if not is_built(directory):  # lost a race to a concurrent builder: theirs is complete
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def build_random_checkpoint(directory, family: str, *, seed: int = 0, tokenizer_kind: str = "char",
                            corpus=None, vocab_size: int = 512, digit_group: int = 1, **architecture) -> Path:
    """Write a randomly initialised HF checkpoint of `family` (architecture fields overridable) to `directory`."""
    from flax import nnx

    from corl_jax.demo.tokenizers import build_tokenizer
    from corl_jax.models import Decoder, ModelConfig, Policy, save_pretrained

    directory = Path(directory)
    tokenizer = build_tokenizer(directory, tokenizer_kind, style=CHAT_STYLE[family], corpus=corpus,
                                vocab_size=vocab_size, digit_group=digit_group)
    hf = dict(TINY_ARCHITECTURES[family], **architecture)
    hf.update(vocab_size=-(-len(tokenizer) // 64) * 64, eos_token_id=tokenizer.eos_token_id,
              bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = ModelConfig.from_hf_dict(hf)
    model = Decoder(config, rngs=nnx.Rngs(seed))
    save_pretrained(Policy(config=config, model=model, tokenizer=tokenizer), directory)
    return directory
