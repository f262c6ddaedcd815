"""The schemes by which the core names things that live outside it: data sources and model paths.

Each entry is a "module:function" string imported on first use, so the core can accept `arithmetic:test` or
`demo:qwen2` without importing the demo world (corl_jax.demo), which itself builds on the core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

# Model families that have built-in stand-in checkpoints (`tiny:<family>`, `demo:<family>`).
FAMILIES = ("qwen2", "llama", "qwen3")

# Data-source scheme -> function(spec) -> list[Problem]; the scheme is a spec's text before ':' or '?'.
DATA_SOURCES = {"arithmetic": "corl_jax.demo.arithmetic:problems_from_spec"}

# Model-path scheme -> function(family) -> checkpoint directory, for model paths `<scheme>:<family>`.
MODEL_PATHS = {"tiny": "corl_jax.demo.checkpoints:tiny_checkpoint_dir",
               "demo": "corl_jax.demo.bases:demo_base_dir"}

# Model-path scheme -> function(families) that builds the missing checkpoints of several families at once.
MODEL_PATH_BATCHES = {"demo": "corl_jax.demo.bases:build_all"}


def _load(target: str) -> Callable:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def data_source(spec: str) -> Callable | None:
    """The generator of a built-in data source named by `spec`, or None for a file or hub source."""
    target = DATA_SOURCES.get(spec.partition(":")[0].partition("?")[0])
    return _load(target) if target else None


def check_family(model_path: str, family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family in model path {model_path!r}; use one of {FAMILIES}")


def resolve_model_path(model_path: str) -> str:
    """A local directory for `model_path`: built-in specs are built on first use; anything else is returned as is."""
    scheme, _, family = model_path.partition(":")
    if scheme == "random" and family:  # a paper checkpoint's shape with random weights (not a family stand-in)
        return str(_load("corl_jax.demo.checkpoints:random_shape_dir")(model_path))
    if scheme in MODEL_PATHS and family:
        check_family(model_path, family)
        return str(_load(MODEL_PATHS[scheme])(family))
    return model_path


def resolve_model_paths(model_paths: list[str]) -> list[str]:
    """`resolve_model_path` of each; missing built-in checkpoints that can be built together are built first."""
    specs = [path.partition(":") for path in model_paths]
    for scheme, target in MODEL_PATH_BATCHES.items():
        families = [family for kind, _, family in specs if kind == scheme and family in FAMILIES]
        if families:  # (an unknown family gets resolve_model_path's error)
            _load(target)(families)
    return [resolve_model_path(p) for p in model_paths]
