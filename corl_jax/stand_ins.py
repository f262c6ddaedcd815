"""`random:<hub id>` model paths: randomly initialised models of a paper checkpoint's real shape, built in memory.

`random:Qwen/Qwen2.5-3B` (any id of `PAPER_MODELS`) resolves to a small cache directory holding the shape's
config.json (real vocabulary size) and the byte-level tokenizer of the family's `tiny:` stand-in, but no weights:
`load_policy` initialises the parameters directly in the agent's dtype and sharding (one jitted init with output
shardings, seed 0, so every load of the same path gives the same weights). The tokenizer's few hundred ids encode
prompts; sampled ids beyond it decode to nothing. `random:<hub id>@FIELD=N,...` overrides integer config.json
fields (e.g. `@num_hidden_layers=1,hidden_size=64`) for CPU smoke runs. For shape, memory and entry-point runs: the weights are noise.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEME = "random:"
_MARKER = "random_init.json"


def resolve_random_path(model_path: str) -> str:
    """The cache directory of a `random:<hub id>[@FIELD=N,...]` path (config.json + tokenizer, no weights)."""
    from corl_jax.demo.checkpoints import CHAT_STYLE, build_once, cache_root
    from corl_jax.models.paper_shapes import PAPER_MODELS

    hub_id, _, options = model_path[len(SCHEME):].partition("@")
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
    name = "random-" + model_path[len(SCHEME):].replace("/", "--").replace("@", "-").replace("=", "").replace(",", "-")

    def build(directory: Path) -> None:
        from corl_jax.demo.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(directory, "char", style=CHAT_STYLE[family])
        hf.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
        (directory / "config.json").write_text(json.dumps(hf, indent=2))
        (directory / _MARKER).write_text(json.dumps({"model_path": model_path, "seed": 0}))

    return str(build_once(cache_root() / "zoo" / name, build))


def is_random(directory) -> bool:
    """Whether `directory` is a resolved `random:` path (weights initialised in memory, none on disk)."""
    return (Path(directory) / _MARKER).is_file()


def load_policy(path, *, dtype, compute_dtype=None, mesh=None, rules=None, remat: str = "none",
                attention: str = "xla"):
    """`from_pretrained(path, ...)`, or for a resolved `random:` directory a random init of its shape."""
    from corl_jax.models import from_pretrained

    if not is_random(path):
        return from_pretrained(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules, remat=remat,
                               attention=attention)
    import jax
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from corl_jax.models import Decoder, ModelConfig, Policy
    from corl_jax.models.sharding import DEFAULT_RULES, state_shardings
    from corl_jax.tokenization import load_tokenizer

    directory = Path(path)
    config = ModelConfig.from_hf_dict(json.loads((directory / "config.json").read_text()), param_dtype=dtype,
                                      dtype=compute_dtype, remat=remat, attention=attention)
    rules = DEFAULT_RULES if rules is None else rules
    seed = json.loads((directory / _MARKER).read_text())["seed"]
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(seed))))
    if mesh is None:
        one_device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one_device, abstract)
    else:
        shardings = state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))[1], out_shardings=shardings)()
    return Policy(config=config, model=nnx.merge(graphdef, state), tokenizer=load_tokenizer(directory), mesh=mesh,
                  rules=rules, generation_config={})
