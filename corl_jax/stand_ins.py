"""`random:<hub id>` model paths: randomly initialised models of a paper checkpoint's real shape, built in memory.

`random:Qwen/Qwen2.5-3B` (any id of `PAPER_MODELS`) resolves (`corl_jax.demo.checkpoints.random_shape_dir`, through
the registry) to a small cache directory holding the shape's config.json (real vocabulary size) and the byte-level
tokenizer of the family's `tiny:` stand-in, but no weights: `load_policy` initialises the parameters directly in the
agent's dtype and sharding (one jitted init with output shardings, seed 0, so every load of the same path gives the
same weights). The tokenizer's few hundred ids encode prompts; sampled ids beyond it decode to nothing.
`random:<hub id>@FIELD=N,...` overrides integer config.json fields (e.g. `@num_hidden_layers=1,hidden_size=64`) for CPU smoke runs.
For shape, memory and entry-point runs: the weights are noise.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "random_init.json"  # in a resolved `random:` directory: the model path and the init seed


def is_random(directory) -> bool:
    """Whether `directory` is a resolved `random:` path (weights initialised in memory, none on disk)."""
    return (Path(directory) / MARKER).is_file()


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
    seed = json.loads((directory / MARKER).read_text())["seed"]
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(seed))))
    if mesh is None:
        one_device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one_device, abstract)
    else:
        shardings = state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))[1], out_shardings=shardings)()
    return Policy(config=config, model=nnx.merge(graphdef, state), tokenizer=load_tokenizer(directory), mesh=mesh,
                  rules=rules, generation_config={})
