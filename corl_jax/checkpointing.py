"""Training-state checkpoints with Orbax: save, keep the last N plus each metric's best, resume.

One checkpoint step holds four items:
  state  the caller's pytree of arrays (per agent: parameters and optimiser state), restored into the caller's
         abstract target, shardings included;
  data   the prompt stream's state (`corl_jax.data.PromptStream.get_state()`), JSON;
  rng    named PRNG keys as uint32 key data (+ the key implementation), JSON;
  meta   the step, its metric(s), the caller's small JSON metadata (config hash, ...) and a fingerprint of every
         array.
Orbax writes each step into a temporary directory and renames it when complete, so a run killed mid-save leaves
the previous steps intact. A state with a non-finite floating-point value is never saved; a restored state must
match the fingerprints written at save (two wrapping uint32 sums of each array's bits, computed on its devices) and
be finite, else the step is rejected. Nothing here ever deletes a checkpoint: a rejected step is moved aside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from corl_jax import multihost

_policies = ocp.checkpoint_managers


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names its directory and the fix."""


class NonFiniteStateError(FloatingPointError):
    """A state to save holds NaN or inf; the message names the array."""


@dataclasses.dataclass
class Snapshot:
    """Everything a run needs to continue from `step`."""

    step: int
    state: Any                      # pytree of arrays
    data_state: Mapping[str, Any]   # PromptStream.get_state()
    rng: Mapping[str, jax.Array]    # name -> PRNG key (typed or raw uint32)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Greater is better. A mapping ranks each key on its own (e.g. agent -> eval accuracy: every agent's best step is
    # kept); a float is the single key "value".
    metric: float | Mapping[str, float] | None = None


class Checkpointer:
    """Orbax-managed checkpoints under `<workdir>/checkpoints/<step>/`.

    Keeps the `keep_last` most recent steps and, with `keep_best`, for every metric key the step with its greatest
    value (the earliest of equal ones, as the reference's BestKeeper takes only a strictly better value).
    Orbax is multi-process aware: on several processes every process must construct, save and restore (each
    writes its own shards; process 0 the metadata and the moves of rejected steps). `workdir` may be any
    `etils.epath` location (gs://...).
    """

    def __init__(self, workdir: str | epath.Path, keep_last: int = 2, keep_best: bool = True,
                 async_save: bool = True):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least the latest checkpoint (1 or more)")
        root = epath.Path(workdir).absolute() if "://" not in str(workdir) else epath.Path(workdir)
        self.directory = root / "checkpoints"
        self.rejected_directory = root / "rejected_checkpoints"
        self.rejected: dict[int, str] = {}  # step -> why, of the steps a fallback restore moved aside
        policies = [_policies.LatestN(n=keep_last)]
        if keep_best:
            policies.append(_BestPerKey())
        options = ocp.CheckpointManagerOptions(  # a best_fn makes Orbax persist each step's metrics (retention: above)
            best_fn=lambda m: float(np.mean(list(_values(m).values()))),
            preservation_policy=_policies.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, snapshot: Snapshot) -> None:
        """Start saving `snapshot` (asynchronously unless `async_save=False`); `wait()` blocks until it is durable."""
        values = None if snapshot.metric is None else (
            dict(snapshot.metric) if isinstance(snapshot.metric, Mapping) else {"value": snapshot.metric})
        if values is not None and not all(math.isfinite(v) for v in values.values()):
            raise ValueError(f"checkpoint metric {snapshot.metric} at step {snapshot.step} is not finite")
        fingerprints = fingerprint(snapshot.state)
        bad = [name for name, entry in fingerprints.items() if not entry["finite"]]
        if bad:
            raise NonFiniteStateError(
                f"step {snapshot.step}: {len(bad)} arrays hold NaN or inf (first: {bad[0]}); not saved, the previous "
                f"checkpoints in {self.directory} are kept")
        meta = {"step": snapshot.step, "metric": snapshot.metric, "metadata": dict(snapshot.metadata),
                "fingerprints": fingerprints}
        self._manager.save(
            snapshot.step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(snapshot.state),
                                    data=ocp.args.JsonSave(dict(snapshot.data_state)),
                                    rng=ocp.args.JsonSave(_encode_keys(snapshot.rng)),
                                    meta=ocp.args.JsonSave(meta)),
            metrics=None if values is None else {"values": values, "step": snapshot.step})

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The `meta` item of `step` alone: {"step", "metric", "metadata"}."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def state_metadata(self, step: int) -> Any:
        """The saved state's tree, each leaf an Orbax ArrayMetadata (`.shape`, `.dtype`); reads no array."""
        return ocp.PyTreeCheckpointHandler().metadata(epath.Path(self.step_dir(step)) / "state").tree

    def restore_subtree(self, step: int, target: Any) -> Any:
        """Only the part of `step`'s state that `target` names (e.g. {agent: {"params": ...}}), laid out (shape,
        dtype, sharding) like `target`'s jax.ShapeDtypeStruct leaves; the rest (optimiser state, other agents) is
        never read."""
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(epath.Path(self.step_dir(step)) / "state", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))

    def step_dir(self, step: int) -> str:
        return str(self.directory / str(step))

    def restore(self, step: int | None = None, *, state_target: Any = None,
                fallback_to_previous: bool = False) -> Snapshot:
        """The snapshot of `step` (default: the latest), its state laid out like `state_target`.

        `state_target` is a pytree like the saved state whose leaves are arrays or jax.ShapeDtypeStruct with a
        sharding; None restores the saved structure as saved. An unreadable or unverifiable step raises
        CheckpointError, or with `fallback_to_previous` is moved to `<workdir>/rejected_checkpoints/` (with a
        warning, recorded in `self.rejected`) and the next older step is tried.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory} (steps there: {steps})")
        candidates = [s for s in reversed(steps) if s <= step] if fallback_to_previous else [step]
        errors = {}
        for candidate in candidates:
            snapshot, why = self._read(candidate, state_target)
            if why is not None:
                errors[candidate] = why
                continue
            for bad, why in errors.items():
                self._set_aside(bad, why)
            return snapshot
        message = (
            "cannot restore " + "; ".join(f"{self.step_dir(s)}: {why}" for s, why in errors.items())
            + ". Nothing was changed. Fix: move that step directory out of checkpoints/ to resume from the previous "
            "step, or start afresh with --config.train.restart=True (moves the old run aside) or a new --workdir"
            + ("" if fallback_to_previous else " (or set --config.train.fallback_to_previous=True)"))
        multihost.raise_as_process_0(CheckpointError(message))

    def agreed_latest_step(self) -> int | None:
        """`latest_step()`, once every process has checked that all of them list the same steps (a collective); a
        host that sees other steps (a workdir that is not shared storage, a stale cache) is a CheckpointError on
        every process."""
        steps = self.all_steps()
        differ = multihost.disagreeing_processes(json.dumps(steps))
        if differ:
            multihost.raise_as_process_0(CheckpointError(
                f"process(es) {differ} list other checkpoint steps in {self.directory} than process 0 ({steps}). "
                "Fix: put the workdir on storage every host sees alike (gs://, a shared filesystem)"))
        return steps[-1] if steps else None

    def _set_aside(self, step: int, why: str) -> None:
        """Move a damaged step out of the managed directory (never delete it), so the run can redo that step."""
        target = self.rejected_directory / f"{step}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        if multihost.is_main():  # every process found the step damaged (the fingerprints are global); one moves it
            self.rejected_directory.mkdir(parents=True, exist_ok=True)
            epath.Path(self.step_dir(step)).rename(target)
        multihost.barrier("checkpoint_set_aside")
        self._manager.reload()
        self.rejected[step] = why
        logging.warning("checkpoint %s is damaged (%s): moved to %s, an older step is restored", self.step_dir(step),
                        why, target)

    def _read(self, step: int, state_target: Any) -> tuple[Snapshot | None, str | None]:
        """(the verified snapshot of `step`, None) or (None, why it was rejected): the same outcome on every process.
        Each process reads its own shards, so a file one host cannot read fails there alone; the read and then the
        check of the fingerprints are each agreed between the processes before the next collective."""
        restored, why = None, None
        try:
            handler = ocp.CompositeCheckpointHandler()  # not the manager: its restore ends in a barrier
            try:                                          # that a process whose read failed never reaches
                with _quiet():
                    restored = handler.restore(epath.Path(self.step_dir(step)), args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(state_target), data=ocp.args.JsonRestore(),
                        rng=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
            finally:
                handler.close()
            if restored["meta"]["step"] != step:
                raise CheckpointError(f"its metadata names step {restored['meta']['step']}")
        except Exception as e:  # Orbax, tensorstore and json raise many types for a damaged directory
            why = _one_line(e)
        if (why := _agreed(why)) is not None:
            return None, why
        meta = restored["meta"]
        try:
            _verify(fingerprint(restored["state"]), meta.get("fingerprints"))
        except CheckpointError as e:  # a replicated array is checked on each process's own copy
            why = _one_line(e)
        if (why := _agreed(why)) is not None:
            return None, why
        return Snapshot(step=step, state=restored["state"], data_state=restored["data"],
                        rng=_decode_keys(restored["rng"]), metadata=meta["metadata"], metric=meta["metric"]), None


def _agreed(why: str | None) -> str | None:
    """The first failing process's `why` on every process (named when there are several), or None if none failed."""
    failure = multihost.first_failure(why)
    if failure is None:
        return None
    return failure[1] if jax.process_count() == 1 else f"on process {failure[0]}: {failure[1]}"


def fingerprint(state: Any) -> dict[str, dict[str, Any]]:
    """Per array of `state` (by path): dtype, whether it is finite, and two wrapping uint32 sums of its bits (plain
    and position-weighted), computed on the array's own devices and exact whatever the sharding."""
    flat = [(path, jax.numpy.asarray(x)) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
    groups: dict[frozenset, list[int]] = {}  # one program per device set (agents may own disjoint devices)
    for i, (_, x) in enumerate(flat):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    sums: list[Any] = [None] * len(flat)
    for indices in groups.values():
        for i, result in zip(indices, _all_sums([flat[i][1] for i in indices])):
            sums[i] = result
    sums = jax.device_get(sums)
    return {_path_name(path): {"dtype": str(np.dtype(x.dtype)), "finite": bool(finite), "sums": [int(a), int(b)]}
            for (path, x), (a, b, finite) in zip(flat, sums)}


@jax.jit
def _all_sums(arrays: list[jax.Array]) -> list:
    return [_sums(x) for x in arrays]


def _sums(x: jax.Array):
    jnp = jax.numpy
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    weights = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0) if x.ndim else jnp.uint32(0)
    for axis in range(1, x.ndim):  # the row-major position of each element, wrapping
        weights = weights * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * (2 * weights + 1), dtype=jnp.uint32), finite


def _verify(restored: Mapping[str, Mapping[str, Any]], saved: Mapping[str, Mapping[str, Any]] | None) -> None:
    """Raise CheckpointError for a restored array that is not finite or differs from its fingerprint at save
    (checkpoints written before fingerprints existed get the finiteness check only)."""
    for name, entry in restored.items():
        expected = (saved or {}).get(name)
        if expected is not None and expected["dtype"] == entry["dtype"] and expected["sums"] != entry["sums"]:
            raise CheckpointError(f"array {name} does not match its checksum written at save (corrupted data)")
        if not entry["finite"]:
            raise CheckpointError(f"array {name} holds NaN or inf")


def _path_name(path) -> str:
    """'qwen/opt_state/0/mu/w': the same for a namedtuple and the dict Orbax restores it as."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _one_line(error: Exception) -> str:
    """The first line of an Orbax/tensorstore error, without the JSON spec it appends."""
    text = str(error).split("See full TensorStore details")[0].strip().splitlines()
    return f"{type(error).__name__}: {(text[0] if text else '')[:300]}"


@contextlib.contextmanager
def _quiet():
    """Orbax logs each failed read at ERROR, with the whole tensorstore spec; the caller reports one line instead."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.FATAL)
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def _values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A step's metric values by key (checkpoints written before per-key metrics hold one "value")."""
    return dict(metrics["values"]) if "values" in metrics else {"value": metrics["value"]}


def _best_per_key(steps_and_metrics) -> dict[str, int]:
    """key -> the step of its greatest value (earliest among equals) over (step, metrics or None) pairs."""
    best: dict[str, tuple[float, int]] = {}
    for step, metrics in sorted(steps_and_metrics, key=lambda x: x[0]):
        for key, value in (_values(metrics) if metrics else {}).items():
            if key not in best or value > best[key][0]:
                best[key] = (value, step)
    return {key: step for key, (_, step) in best.items()}


class _BestPerKey(_policies.PreservationPolicy):
    """Orbax preservation policy: keep every step that is some metric key's best."""

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        keep = set(_best_per_key([(c.step, c.metrics) for c in checkpoints]).values())
        return [c.step in keep for c in checkpoints]


def _encode_keys(keys: Mapping[str, jax.Array]) -> dict[str, dict[str, Any]]:
    encoded = {}
    for name, key in keys.items():
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        data = np.asarray(jax.device_get(jax.random.key_data(key) if typed else key))
        if data.dtype != np.uint32:
            raise TypeError(f"rng {name!r}: not a PRNG key (dtype {key.dtype}); pass jax.random.key(...) keys")
        encoded[name] = {"impl": str(jax.random.key_impl(key)) if typed else None, "data": data.tolist()}
    return encoded


def _decode_keys(encoded: Mapping[str, Mapping[str, Any]]) -> dict[str, jax.Array]:
    keys = {}
    for name, entry in encoded.items():
        data = jax.numpy.asarray(np.array(entry["data"], dtype=np.uint32))
        keys[name] = data if entry["impl"] is None else jax.random.wrap_key_data(data, impl=entry["impl"])
    return keys
