"""Training-state checkpoints with Orbax: save, keep the last N plus the best, resume.

One checkpoint step holds four items:
  state  the caller's pytree of arrays (per agent: parameters and optimiser state), restored into the caller's
         abstract target, shardings included;
  data   the prompt stream's state (`corl_jax.data.PromptStream.get_state()`), JSON;
  rng    named PRNG keys as uint32 key data (+ the key implementation), JSON;
  meta   the step, its metric and the caller's small JSON metadata (config hash, ...).
Orbax writes each step into a temporary directory and renames it when complete, so a run killed mid-save leaves
the previous steps intact. Nothing here ever deletes a checkpoint because it could not be read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

_policies = ocp.checkpoint_managers


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read; the message names its directory and the fix."""


@dataclasses.dataclass
class Snapshot:
    """Everything a run needs to continue from `step`."""

    step: int
    state: Any                      # pytree of arrays
    data_state: Mapping[str, Any]   # PromptStream.get_state()
    rng: Mapping[str, jax.Array]    # name -> PRNG key (typed or raw uint32)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    metric: float | None = None     # e.g. mean eval accuracy; greater is better


class Checkpointer:
    """Orbax-managed checkpoints under `<workdir>/checkpoints/<step>/`.

    Keeps the `keep_last` most recent steps and, with `keep_best`, also the step with the greatest metric (the
    earliest of equal ones, as the reference's BestKeeper takes only a strictly better value).
    Orbax is multi-process aware: on several processes every process must construct, save and restore (each
    writes its own shards; process 0 the metadata). `workdir` may be any `etils.epath` location (gs://...).
    """

    def __init__(self, workdir: str | epath.Path, keep_last: int = 2, keep_best: bool = True,
                 async_save: bool = True):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least the latest checkpoint (1 or more)")
        local = "://" not in str(workdir)
        self.directory = (epath.Path(workdir).absolute() if local else epath.Path(workdir)) / "checkpoints"
        policies = [_policies.LatestN(n=keep_last)]
        if keep_best:
            policies.append(_policies.BestN(get_metric_fn=_rank, n=1, keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(  # best_fn also makes Orbax persist each step's metric
            best_fn=_rank, preservation_policy=_policies.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, snapshot: Snapshot) -> None:
        """Start saving `snapshot` (asynchronously unless `async_save=False`); `wait()` blocks until it is durable."""
        if snapshot.metric is not None and not math.isfinite(snapshot.metric):
            raise ValueError(f"checkpoint metric {snapshot.metric} at step {snapshot.step} is not finite")
        meta = {"step": snapshot.step, "metric": snapshot.metric, "metadata": dict(snapshot.metadata)}
        self._manager.save(
            snapshot.step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(snapshot.state),
                                    data=ocp.args.JsonSave(dict(snapshot.data_state)),
                                    rng=ocp.args.JsonSave(_encode_keys(snapshot.rng)),
                                    meta=ocp.args.JsonSave(meta)),
            metrics=None if snapshot.metric is None else {"value": snapshot.metric, "step": snapshot.step})

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

    def best_step(self) -> int | None:
        """The kept step with the greatest metric (earliest among equals); None when no step has a metric."""
        return self._manager.best_step() if any(self._manager.metrics(s) for s in self.all_steps()) else None

    def step_dir(self, step: int) -> str:
        return str(self.directory / str(step))

    def restore(self, step: int | None = None, *, state_target: Any = None,
                fallback_to_previous: bool = False) -> Snapshot:
        """The snapshot of `step` (default: the latest), its state laid out like `state_target`.

        `state_target` is a pytree like the saved state whose leaves are arrays or jax.ShapeDtypeStruct with a
        sharding; None restores the saved structure as saved. An unreadable step raises CheckpointError, or with
        `fallback_to_previous` is skipped (with a warning) for the next older readable step.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}")
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory} (steps there: {steps})")
        candidates = [s for s in reversed(steps) if s <= step] if fallback_to_previous else [step]
        errors = []
        for candidate in candidates:
            try:
                return self._read(candidate, state_target)
            except Exception as e:  # Orbax, tensorstore and json raise many types for a damaged directory
                errors.append(f"{self.step_dir(candidate)}: {type(e).__name__}: {str(e)[:400]}")
                if fallback_to_previous:
                    logging.warning("checkpoint %s is unreadable, trying an older one: %s", candidate, errors[-1])
        raise CheckpointError(
            "cannot read checkpoint " + "; ".join(errors) + ". Fix: delete that step directory to resume from the "
            "previous step, or start afresh with --config.train.resume=False and a new --workdir"
            + ("" if fallback_to_previous else ", or restore with fallback_to_previous=True"))

    def restore_latest(self, state_target: Any = None, fallback_to_previous: bool = False) -> Snapshot | None:
        """Automatic resume: the latest snapshot, or None when the workdir has no checkpoint yet."""
        if self.latest_step() is None:
            return None
        return self.restore(state_target=state_target, fallback_to_previous=fallback_to_previous)

    def _read(self, step: int, state_target: Any) -> Snapshot:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state_target), data=ocp.args.JsonRestore(),
                                          rng=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        meta = restored["meta"]
        if meta["step"] != step:
            raise CheckpointError(f"its metadata names step {meta['step']}")
        return Snapshot(step=step, state=restored["state"], data_state=restored["data"],
                        rng=_decode_keys(restored["rng"]), metadata=meta["metadata"], metric=meta["metric"])


def _rank(metrics: Mapping[str, Any]) -> tuple[float, int]:
    """Greater is better; among equal values the earlier step wins."""
    return metrics["value"], -metrics["step"]


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
