"""The run directory: whether a run starts, resumes or restarts in it, and the history of the configs it used.

  empty workdir                   a new run
  used workdir, train.resume      the run continues; the saved config.json is compared with the new config: keys in
                                  SAFE_ON_RESUME may change (with a warning), any other difference is refused
  used workdir, train.restart     the old run is moved to `<workdir>/previous-<UTC time>/` (never deleted), a new
                                  run starts
  used workdir, neither           refused: a new run would mix its files with the old run's

`config.json` always holds the current config; `config_history.jsonl` gets one line per start (the step it
started from, what changed, the whole config), so every config a run has used is kept.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

import ml_collections
from absl import logging
from etils import epath

from corl_jax.config import agent_config, base_config

# Keys that may change when a run resumes: run length and cadence, logging, retention, fault handling, and speed or
# memory settings that do not change results beyond float noise. Anything else (models, data, learning rate,
# sampling, eval settings) would make the resumed run a different experiment than its first part.
SAFE_ON_RESUME = (
    "train.max_steps", "train.eval_every", "train.eval_on_start", "train.save_every", "train.keep_last",
    "train.log_records", "train.resume", "train.restart", "train.fallback_to_previous",
    "train.max_nonfinite_updates", "train.eval_batch_prompts", "grpo.micro_batch_size", "grpo.logprob_chunk_size",
    "grpo.remat", "grpo.attention", "grpo.length_bucket", "grpo.packing", "rollout.decode_attention", "rollout.decode_compaction",
    "code.sandbox_workers", "placement", "mesh.data",
    "mesh.fsdp", "mesh.tensor",
)
_PREVIOUS = "previous-"


class WorkdirError(ValueError):
    """A workdir that cannot hold this run; the message names it and the fix."""


def prepare(config: ml_collections.ConfigDict, workdir: str | epath.Path) -> dict[str, tuple[Any, Any]]:
    """Make `workdir` (any etils.epath location, gs://...) ready for `config` (see the module docstring) before any
    model loads.

    Returns the config keys that changed since the run's last start, as {key: (old, new)} (empty for a new run).
    """
    workdir = epath.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirError(f"workdir {workdir} is a file, not a directory. Fix: pass a directory path as --workdir")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise WorkdirError(f"workdir {workdir} cannot be created or written ({e.strerror}). Fix: pass a writable "
                           "--workdir") from e
    used = sorted(p.name for p in workdir.iterdir() if not p.name.startswith(_PREVIOUS))
    if not used:
        return {}
    if config.train.restart:
        _move_aside(workdir, used)
        return {}
    if not config.train.resume:
        raise WorkdirError(
            f"workdir {workdir} already holds a run ({', '.join(used[:4])}{', ...' if len(used) > 4 else ''}) and "
            "train.resume=False would mix a new run into it. Fix: --config.train.restart=True moves the old run to "
            f"{workdir / _PREVIOUS}<time>/ and starts afresh; or use a new --workdir")
    saved_path = workdir / "config.json"
    if not saved_path.exists():
        return {}
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WorkdirError(f"{saved_path} cannot be read as JSON ({e}). Fix: restore it from config_history.jsonl's "
                           "last entry, or add --config.train.restart=True to move the old run aside") from e
    changes = config_changes(saved, json.loads(config.to_json_best_effort()))
    refused = {k: v for k, v in changes.items() if k not in SAFE_ON_RESUME}
    if refused:
        raise WorkdirError(
            f"workdir {workdir} holds a run with another config, and these keys cannot change on resume: "
            f"{_describe(refused)}. Fix: keep them as in {saved_path}; or run this config in a new --workdir; or add "
            "--config.train.restart=True to move the old run aside and start afresh")
    if changes:
        note = (f" (the learning-rate schedule now spans {config.train.max_steps} steps)"
                if "train.max_steps" in changes else "")
        logging.warning("resuming %s with changed settings: %s%s", workdir, _describe(changes), note)
    return changes


def record_config(config: ml_collections.ConfigDict, workdir: str | epath.Path, start_step: int,
                  changes: Mapping[str, tuple[Any, Any]]) -> None:
    """Write config.json (the current config) and append this start to config_history.jsonl."""
    text = config.to_json_best_effort(indent=2)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "start_step": start_step,
             "changes": {k: list(v) for k, v in changes.items()}, "config": json.loads(text)}
    workdir = epath.Path(workdir)
    history = workdir / "config_history.jsonl"  # rewritten whole: gs:// objects cannot be appended to
    _replace(history, (history.read_text() if history.exists() else "") + json.dumps(entry) + "\n")
    _replace(workdir / "config.json", text)


def _replace(path: epath.Path, text: str) -> None:
    """Write `path` through a temporary file renamed over it, so a crash leaves the old or the new text."""
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, new value)} of the differences. A key the saved config lacks (written before the
    key existed) counts as its default; agents present on one side only differ in every key."""
    old, cur = _flatten(saved), _flatten(new)
    defaults = _flatten(json.loads(base_config().to_json_best_effort()))
    agent_defaults = _flatten(json.loads(agent_config("", "").to_json_best_effort()))
    old_agents = set(saved.get("agents", {}))
    changes = {}
    for key in sorted(old.keys() | cur.keys()):
        missing = object()
        before = old.get(key, missing)
        if before is missing:
            parts = key.split(".")
            if parts[0] == "agents" and len(parts) == 3 and parts[1] in old_agents:
                before = agent_defaults.get(parts[2])
            elif parts[0] != "agents":
                before = defaults.get(key)
            else:
                before = None
        after = cur.get(key)
        if before != after:
            changes[key] = (before, after)
    return changes


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _describe(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def _move_aside(workdir: epath.Path, names: list[str]) -> None:
    target = workdir / (_PREVIOUS + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    while target.exists():  # two restarts within a second
        target = target.parent / (target.name + "+")
    target.mkdir(parents=True)
    for name in names:
        (workdir / name).rename(target / name)
    logging.warning("train.restart: the previous run in %s was moved to %s", workdir, target)
