"""Several JAX processes (one per host of a pod, or several on one machine): start-up, host reads of global arrays,
process-0-only outputs, and host-computed values that every process must share.

Every process runs the same program (JAX's multi-controller model). Device work is identical by construction;
host work that can differ between processes (answer grading is bounded in wall-clock time, so a slow host can
time out where another did not) is done by process 0 only and broadcast, so every process applies the same update.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils

_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS")


def multi_host_environment() -> bool:
    """A launcher's environment (coordinator address, GKE TPU hosts, SLURM) or a Cloud TPU VM, where
    `jax.distributed.initialize()` finds the slice's hosts itself (one process on a single-host slice)."""
    if any(v in os.environ for v in _CLUSTER_ENV):
        return True
    try:
        from jax._src import hardware_utils  # the check JAX itself uses before querying the TPU metadata server
    except ImportError:
        return False
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int | None = None) -> None:
    """`jax.distributed.initialize`: unset arguments are auto-detected (Cloud TPU, SLURM, ... or
    JAX_COORDINATOR_ADDRESS). `heartbeat_timeout_seconds` (JAX's default: 100) is how long a silent process (killed,
    hung) goes unnoticed before the coordination service stops every process."""
    if heartbeat_timeout_seconds is not None and heartbeat_timeout_seconds < 1:
        raise ValueError(f"heartbeat_timeout_seconds={heartbeat_timeout_seconds}: use 1 or more seconds")
    extra = {} if heartbeat_timeout_seconds is None else {"heartbeat_timeout_seconds": heartbeat_timeout_seconds}
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **extra)


def is_main() -> bool:
    """Process 0 writes the run's files and prints; every process takes part in checkpoints and collectives."""
    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """The full value of every array of `tree` as numpy, on every process. Arrays spanning several processes are
    gathered (a collective: every process must call this in the same order); local arrays are read directly."""

    def read(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    return jax.tree.map(read, tree)


def settled(tree: Any) -> Any:
    """`tree` once computed, where several CPU processes run; else `tree` as is (dispatch stays asynchronous).
    The CPU backend runs every cross-process collective over one gloo connection per process pair, so two programs
    in flight at once (agents on disjoint devices, partitioned placement) could interleave their collectives in a
    different order on each process: a mismatch that aborts the run. TPU and GPU collectives do not go through
    gloo, so there the dispatch stays asynchronous."""
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        jax.block_until_ready(tree)
    return tree


def broadcast(tree: Any) -> Any:
    """Process 0's value of `tree` (numpy arrays of equal shapes on every process) on every process."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree)


def barrier(name: str) -> None:
    """Wait until every process reaches this point (e.g. after process 0 changed files the others read next)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on some process (a collective: every process must call this in the same order)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _broadcast_text(text: str) -> str:
    """Process 0's `text` on every process (two broadcasts: its length, then its UTF-8 bytes)."""
    data = np.frombuffer(text.encode(), np.uint8)
    size = int(broadcast(np.array(data.size, np.int32)))
    if not size:
        return ""
    return bytes(broadcast(data if is_main() else np.zeros(size, np.uint8))).decode()


def first_error(fn: Callable[[], Any], errors: tuple[type[Exception], ...]) -> Any:
    """`fn()` on process 0 only (its value there, None elsewhere). If it raises one of `errors`, every process raises
    that error type with process 0's message, so a refusal seen by process 0 alone (an unreadable file, a workdir
    check) ends every process with the same one-line error instead of a hang in the next collective."""
    result, kind, message = None, -1, ""
    if is_main():
        try:
            result = fn()
        except errors as e:
            kind, message = next(i for i, t in enumerate(errors) if isinstance(e, t)), str(e)
            if jax.process_count() == 1:
                raise
    if jax.process_count() > 1:
        kind = int(broadcast(np.array(kind, np.int32)))
        message = _broadcast_text(message)
    if kind >= 0:
        raise errors[kind](message)
    return result


def first_failure(message: str | None) -> tuple[int, str] | None:
    """(process, message) of the lowest process whose `message` is not None, the same on every process; None when
    every process passed None (a collective: every process must call this in the same order). Lets a local outcome
    (a file one host cannot read) become one decision that every process takes."""
    if jax.process_count() == 1:
        return None if message is None else (0, message)
    data = np.frombuffer((message or "").encode(), np.uint8)
    heads = np.asarray(multihost_utils.process_allgather(np.array([message is not None, data.size], np.int32)))
    failing = [i for i in range(heads.shape[0]) if heads[i, 0]]
    if not failing:
        return None
    size = max(1, int(heads[:, 1].max()))
    texts = np.asarray(multihost_utils.process_allgather(np.pad(data, (0, size - data.size))))
    first = failing[0]
    return first, bytes(texts[first, :heads[first, 1]]).decode()


def raise_as_process_0(error: Exception) -> NoReturn:
    """Raise on every process `error`'s type with process 0's message (each process passes its own error of one
    type, whose text may differ in local details such as paths), so every process prints the same line (a
    collective)."""
    if jax.process_count() == 1:
        raise error
    raise type(error)(_broadcast_text(str(error)))


def disagreeing_processes(text: str) -> list[int]:
    """The processes whose `text` (e.g. the resolved config as JSON) differs from process 0's (a collective: every
    process gets the same list)."""
    if jax.process_count() == 1:
        return []
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest))
    return [i for i in range(1, digests.shape[0]) if not np.array_equal(digests[i], digests[0])]
