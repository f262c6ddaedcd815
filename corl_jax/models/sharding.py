"""Logical-axis sharding: parameter/activation axis names -> mesh axes -> `NamedSharding`s.

Every decoder parameter carries `logical_axes` metadata (e.g. ("layers", "embed", "heads",
"head_dim")). A rule set maps each logical name to mesh axes of a ("data", "fsdp", "tensor") mesh.
A dimension whose size is not divisible by its mesh axes keeps the longest prefix of those axes
that divides it (often none: replicated), so tiny models run on any mesh.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. "batch" is activations/inputs; the rest are parameter/cache axes.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("head_dim", ()),
    ("layers", ()),
    ("norm", ()),
    ("cache_seq", ()),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh of data*fsdp*tensor devices (default: the first ones available)."""
    n = data * fsdp * tensor
    devices = list(jax.devices()[:n] if devices is None else devices)
    if len(devices) != n:
        raise ValueError(f"mesh data={data} fsdp={fsdp} tensor={tensor} needs {n} devices, got {len(devices)}")
    auto = (jax.sharding.AxisType.Auto,) * 3
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=auto, devices=devices)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims have `logical_axes`; unknown names replicate.

    A mesh axis is used at most once per array (first dimension wins)."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape):
        axes = [a for a in table.get(name, ()) if a not in used]
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*spec)


def named_sharding(logical_axes, shape, mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def variable_sharding(variable: nnx.Variable, mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of one (concrete or abstract) NNX variable from its `logical_axes` metadata."""
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
        raise ValueError(f"variable of shape {variable.shape} has no logical_axes metadata")
    return named_sharding(axes, variable.shape, mesh, rules)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings with the structure of an nnx State (concrete or abstract)."""
    return jax.tree.map(lambda v: variable_sharding(v, mesh, rules), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of an input/activation array whose leading dim is the batch (other dims replicated)."""
    return named_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules)


def cache_shardings(cache, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a `KVCache` (batch over the data axes, kv heads over tensor)."""
    return jax.tree.map(lambda axes, x: named_sharding(axes, x.shape, mesh, rules),
                        type(cache).logical_axes(), cache, is_leaf=lambda x: isinstance(x, tuple))
