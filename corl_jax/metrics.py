"""Run outputs: per-step scalars (metrics.jsonl + TensorBoard), per-prompt vote records, summary.json."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

import numpy as np
from etils import epath


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
    `workdir` may be any `etils.epath` location (gs://...). An inactive log (the processes other than 0 of a
    multi-process run) writes nothing.
    """

    def __init__(self, workdir: str | epath.Path, resume_step: int = 0, active: bool = True):
        self.active = active
        if not active:
            return
        workdir = epath.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self._metrics_path = workdir / "metrics.jsonl"
        self._records_path = workdir / "records.jsonl"
        for path in (self._metrics_path, self._records_path):
            _truncate_after(path, resume_step)
        self._metrics = self._metrics_path.open("a")
        self._records = self._records_path.open("a")
        from tensorboardX import SummaryWriter  # heavy import, only for real runs

        self._tb = SummaryWriter(str(workdir / "tensorboard"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not self.active:
            return
        self._metrics.write(json.dumps({"step": step, **_plain(values)}) + "\n")
        self._metrics.flush()
        for key, value in values.items():
            if isinstance(value, (int, float, np.floating, np.integer)) and math.isfinite(float(value)):
                self._tb.add_scalar(key, float(value), step)
        self._tb.flush()

    def records(self, rows: list[Mapping[str, Any]]) -> None:
        if not self.active:
            return
        for row in rows:
            self._records.write(json.dumps(_plain(row)) + "\n")
        self._records.flush()

    def close(self) -> None:
        if not self.active:
            return
        self._metrics.close()
        self._records.close()
        self._tb.close()


def _truncate_after(path: epath.Path, step: int) -> None:
    """Keep only the lines of `path` whose `step` is at most `step` (all lines when the file is new)."""
    if not path.exists():
        return
    with path.open() as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    _replace(path, "".join(kept))


def write_json(path: str | epath.Path, payload: Mapping[str, Any]) -> None:
    """Write JSON atomically (temp file + rename)."""
    _replace(epath.Path(path), json.dumps(_plain(payload), indent=2))


def _replace(path: epath.Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path` (atomic on local disks)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
