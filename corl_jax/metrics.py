"""Run outputs: per-step scalars (metrics.jsonl + TensorBoard), per-prompt vote records, summary.json."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np


def _plain(value: Any) -> Any:
    """JSON-able version of numpy / jax scalars and arrays."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(np.asarray(value).tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class RunLog:
    """Appends step metrics to `metrics.jsonl` and TensorBoard, and vote records to `records.jsonl`.

    Files are opened in append mode so that a resumed run continues them; lines of steps after the resume point
    (written by the killed process after its last checkpoint) are dropped on open, so every step appears once.
    """

    def __init__(self, workdir: str, resume_step: int = 0):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self._metrics_path = os.path.join(workdir, "metrics.jsonl")
        self._records_path = os.path.join(workdir, "records.jsonl")
        for path in (self._metrics_path, self._records_path):
            _truncate_after(path, resume_step)
        self._metrics = open(self._metrics_path, "a")
        self._records = open(self._records_path, "a")
        from tensorboardX import SummaryWriter  # heavy import, only for real runs

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._metrics.write(json.dumps({"step": step, **_plain(values)}) + "\n")
        self._metrics.flush()
        for key, value in values.items():
            if isinstance(value, (int, float, np.floating, np.integer)) and math.isfinite(float(value)):
                self._tb.add_scalar(key, float(value), step)
        self._tb.flush()

    def records(self, rows: list[Mapping[str, Any]]) -> None:
        for row in rows:
            self._records.write(json.dumps(_plain(row)) + "\n")
        self._records.flush()

    def close(self) -> None:
        self._metrics.close()
        self._records.close()
        self._tb.close()


def _truncate_after(path: str, step: int) -> None:
    """Keep only the lines of `path` whose `step` is at most `step` (all lines when the file is new)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def write_json(path: str, payload: Mapping[str, Any]) -> None:
    """Write JSON atomically (temp file + rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_plain(payload), f, indent=2)
    os.replace(tmp, path)
