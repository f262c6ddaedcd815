"""Several JAX processes on this machine (CPU devices, gloo collectives through `jax.distributed`) train exactly as
one process with as many devices: same metrics, same final parameters; only process 0 writes the run's files;
every process writes its checkpoint shards; a SIGKILL of one process stops the others, and a restart of all resumes
exactly; an error that one process alone sees (config, workdir, checkpoint) ends every process with one line."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from corl_jax.checkpointing import Checkpointer
from cpu_flags import xla_flags_with_devices

REPO = Path(__file__).resolve().parents[1]
STEPS = ("--config.train.max_steps=2", "--config.train.save_every=1", "--config.train.eval_every=2",
         "--config.train.eval_on_start=False", "--config.rollout.max_new_tokens=8", "--config.mesh.data=-1")
TIMEOUT = 900  # hang guard per run (the slowest, 2 x 4 with a cold compilation cache, takes ~5 min in the loaded CI)
HEARTBEAT = "--heartbeat_timeout_seconds=10"  # a killed process is noticed by the others in seconds, not JAX's 100
# The shared runs train with the paper-scale update (packed lines, `grpo.packing`), the partitioned ones with the
# `:tiny` variant's unpacked, length-bucketed update: both update paths run across processes.
PLACEMENT = {"shared": ("--config.placement=shared", "--config.grpo.packing=True", "--config.grpo.length_bucket=64"),
             "partitioned": ("--config.placement=partitioned",)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(workdir: Path, processes: int, devices: int, *flags: str,
            only: dict[int, tuple[str, ...]] | None = None) -> list[subprocess.Popen]:
    """`processes` trainers of `configs/ring3.py:tiny` with `devices` CPU devices each, sharing `workdir`; `only`
    adds flags to some processes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags_with_devices(devices),
           "PYTHONFAULTHANDLER": "1"}  # SIGABRT (`_stacks`) prints every thread's Python stack
    cmd = [sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py:tiny", f"--workdir={workdir}", *STEPS,
           *flags]
    if processes > 1:
        cmd += [f"--coordinator_address=localhost:{_free_port()}", f"--num_processes={processes}", HEARTBEAT]
    only = only or {}
    return [subprocess.Popen(cmd + ([f"--process_id={i}"] if processes > 1 else []) + list(only.get(i, ())), cwd=REPO,
                             env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(processes)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _stacks(procs: list[subprocess.Popen], done: int) -> str:
    """The output tail of every process from `procs[done]` on, each first made to print its threads' Python stacks
    (SIGABRT; a hung run's only evidence of where it waits)."""
    for p in procs[done:]:
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
    tails = {i: p.communicate(timeout=120)[0][-5000:] for i, p in enumerate(procs) if i >= done}
    return "\n".join(f"--- process {i} (exit {procs[i].returncode}):\n{tail}" for i, tail in tails.items())


def _outputs(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[str]:
    """Every process's output once all exited; past `timeout` each process's stacks fail the test."""
    deadline, outputs = time.time() + timeout, []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"no exit within {timeout:.0f} s (a hang):\n{_stacks(procs, len(outputs))}")
    finally:
        _kill(procs)
    return outputs


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Every process's output once all exited 0; on a failure or timeout all are killed and the outputs shown."""
    outputs = _outputs(procs)
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-6000:]}"
    return outputs


def _run(workdir: Path, processes: int, devices: int, *flags: str) -> list[str]:
    return _finish(_launch(workdir, processes, devices, *flags))


def _rows(workdir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (workdir / name).read_text().splitlines()]


def _without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if "time/" not in k} for r in rows]


def _final_state(workdir: Path, like=None):
    target = None if like is None else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    with Checkpointer(str(workdir)) as c:
        return c.restore(c.latest_step(), state_target=target).state


def _assert_same_metrics(reference: list[dict], run: list[dict]) -> None:
    """The same logged keys and values; floats within 1e-6, relative or absolute (a few float32 ulps; a zero loss,
    a sum of terms that cancel, came out as -7.5e-9 across processes)."""
    assert [sorted(r) for r in run] == [sorted(r) for r in reference]
    for ref, got in zip(reference, run):
        off = {k: (ref[k], got[k]) for k in ref if ref[k] != got[k] and not (
            isinstance(ref[k], float) and np.isclose(got[k], ref[k], rtol=1e-6, atol=1e-6))}
        assert not off, f"step {ref['step']}: (one process, several processes): {off}"


def _assert_same_run(reference: Path, run: Path) -> None:
    # Same completions, same grading: every logged value (rewards, losses, grad norms, eval) is the same. Sums over
    # the 8 (6) devices run in another order across processes (gloo) than within one: a metric summed over packed
    # lines may differ in its last float32 bits (seen: entropy 5.752535343 vs 5.752535820, a loss of 0.0 vs
    # -7.5e-9), and Adam moments may differ in the last bits (seen: 9e-11 absolute); Adam divides each gradient
    # element by its RMS, so where that is near zero a parameter can move by a little more (seen: one element of
    # 16384 off by 6e-7 unpacked and by 1.3e-6 packed, i.e. 0.13% of one lr=1e-3 update). The tolerances are that
    # reduction-order noise, 1% of one update.
    _assert_same_metrics(_without_timings(_rows(reference, "metrics.jsonl")),
                         _without_timings(_rows(run, "metrics.jsonl")))
    a = _final_state(reference)
    b = _final_state(run, like=a)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """The trainers' model zoo, shared by this module's runs (inherited through the environment; the single-process
    run builds it first). Their programs go to the session's compilation cache: the runs of one topology (2 x 4
    shared: the killed run and its restart) compile once, bit for bit what each would compile."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CORL_JAX_CACHE", str(tmp_path_factory.mktemp("zoo_cache")))
        yield os.environ["CORL_JAX_CACHE"]


@pytest.fixture(scope="module")
def single_process_run(zoo, tmp_path_factory):
    """The workdir of the one-process run with `devices` devices and `placement` (each run once per module)."""
    runs = {}

    def get(placement: str, devices: int) -> Path:
        if (placement, devices) not in runs:
            runs[placement, devices] = tmp_path_factory.mktemp(f"one_{placement}")
            _run(runs[placement, devices], 1, devices, *PLACEMENT[placement])
        return runs[placement, devices]

    return get


def _assert_written_once(run: Path, outputs: list[str]) -> None:
    """Records, summary and the eval line come from process 0 alone; every process wrote its checkpoint shards."""
    assert len(_rows(run, "records.jsonl")) == 2 * 2 * 3  # steps x prompts x agents: written once, by process 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert "eval accuracy" in outputs[0] and all("eval accuracy" not in out for out in outputs[1:])
    shards = {p.name for p in (run / "checkpoints" / "2" / "state").iterdir() if p.name.startswith("ocdbt.process_")}
    assert shards == {f"ocdbt.process_{i}" for i in range(len(outputs))}


def test_processes_train_like_one_process(single_process_run, tmp_path):
    """Partitioned placement, 2 x 3 devices; the shared placement (2 x 4) trains across processes in the SIGKILL
    test below, whose killed run (step 1) and restart (step 2) together must equal the one-process run."""
    outputs = _run(tmp_path / "many", 2, 3, *PLACEMENT["partitioned"])
    _assert_same_run(single_process_run("partitioned", 6), tmp_path / "many")
    _assert_written_once(tmp_path / "many", outputs)


def test_sigkill_of_one_process_stops_the_others_then_restart_resumes_exactly(single_process_run, tmp_path):
    procs = _launch(tmp_path / "killed", 2, 4, *PLACEMENT["shared"])
    checkpoints, deadline = tmp_path / "killed" / "checkpoints", time.time() + TIMEOUT
    try:
        while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
            assert all(p.poll() is None for p in procs) and time.time() < deadline, _finish(procs)
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        out = _outputs(procs[:1])[0]  # ends by itself (its collective fails or the heartbeat times out): no hang
        assert procs[0].returncode != 0, out[-3000:]
    finally:
        _kill(procs)
    assert 1 in Checkpointer(str(checkpoints.parent)).all_steps()
    outputs = _run(tmp_path / "killed", 2, 4, *PLACEMENT["shared"])
    _assert_same_run(single_process_run("shared", 8), tmp_path / "killed")
    _assert_written_once(tmp_path / "killed", outputs)


def _refusals(procs: list[subprocess.Popen]) -> list[str]:
    """Every process's `error:` lines once all exited 2 (on a hang past the guard all are killed)."""
    outputs = _outputs(procs)
    assert [p.returncode for p in procs] == [2] * len(procs), outputs
    return [[line for line in out.splitlines() if line.startswith("error: ")] for out in outputs]


def test_hosts_disagreeing_on_the_config_all_exit_2_with_one_line(tmp_path):
    errors = _refusals(_launch(tmp_path / "run", 2, 1, only={1: ("--config.seed=7",)}))
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert "process(es) [1] resolved another config than process 0" in errors[0][0]
    assert "run the same command" in errors[0][0]
    assert not (tmp_path / "run").exists()  # refused before process 0 touched the workdir


def test_corrupt_config_json_seen_by_process_0_stops_every_process_with_its_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{not json")
    errors = _refusals(_launch(tmp_path / "run", 2, 1))
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert "config.json cannot be read as JSON" in errors[0][0] and "Fix:" in errors[0][0]


@pytest.mark.parametrize("view", ["damaged", "stale"])
def test_checkpoint_one_process_cannot_read_stops_every_process_with_one_line(view, single_process_run, tmp_path):
    """Process 1 sees another copy of the workdir (as a host with a damaged or stale view of shared storage would):
    `damaged`: step 2 lacks its largest array file and step 1's is corrupt, so both processes agree that neither step
    can be restored; `stale`: step 2 is missing, so the processes list different steps. Every process ends with
    process 0's line, which names process 1; nothing is moved aside."""
    seen, unseen = tmp_path / "seen", tmp_path / "unseen"
    for copy in (seen, unseen):
        shutil.copytree(single_process_run("shared", 8), copy)
    for step in ("1", "2") if view == "damaged" else ():
        files = [p for p in (unseen / "checkpoints" / step / "state").rglob("*") if p.is_file()]
        largest = max(files, key=lambda p: p.stat().st_size)
        if step == "2":
            largest.unlink()
        else:
            data = bytearray(largest.read_bytes())
            data[len(data) // 2:] = bytes(b ^ 0xFF for b in data[len(data) // 2:])
            largest.write_bytes(bytes(data))
    if view == "stale":
        shutil.rmtree(unseen / "checkpoints" / "2")
    errors = _refusals(_launch(seen, 2, 1, *PLACEMENT["shared"], only={1: (f"--workdir={unseen}",)}))
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    line = errors[0][0]
    if view == "damaged":
        assert line.startswith("error: cannot restore") and "restart=True" in line, line
        assert f"{seen}/checkpoints/2: on process 1: " in line and f"{seen}/checkpoints/1: on process 1: " in line
    else:
        assert f"process(es) [1] list other checkpoint steps in {seen}/checkpoints than process 0 ([1, 2])" in line
        assert "shared filesystem" in line
    assert sorted(os.listdir(seen / "checkpoints")) == ["1", "2"] and not (seen / "rejected_checkpoints").exists()


def test_run_files_and_data_go_through_epath(monkeypatch):
    """gs:// workdirs and data: the run's files and data reads go through etils.epath (here onto fsspec's in-memory
    filesystem registered for gs://, as gcsfs is on a pod); nothing lands on the local disk under a mangled path.
    (Orbax checkpoints reach gs:// through tensorstore's own GCS driver, not exercised here.)"""
    import fsspec
    import tensorboardX
    from etils import epath
    from fsspec.implementations.memory import MemoryFileSystem

    from corl_jax import data
    from corl_jax import workdir as run_dir
    from corl_jax.config import base_config
    from corl_jax.metrics import RunLog, write_json

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, finalize_on_close=False, **kwargs):  # etils passes gcsfs's option
            super().__init__(*args, **kwargs)

    class Board:  # tensorboardX writes gs:// itself (google-cloud-storage): record the location it is given
        logdirs = []

        def __init__(self, logdir):
            self.logdirs.append(logdir)

        add_scalar = flush = close = lambda self, *args: None

    for protocol in FakeGCS.protocol:
        fsspec.register_implementation(protocol, FakeGCS, clobber=True)
    monkeypatch.setattr(tensorboardX, "SummaryWriter", Board)
    monkeypatch.chdir(REPO)  # a mangled relative "gs:/..." path would appear here
    run = epath.Path("gs://bucket/run")
    try:
        log = RunLog(run)
        for step in (1, 2):
            log.scalars(step, {"a/loss": float(step)})
            log.records([{"step": step, "prompt_id": 0}])
        log.close()
        RunLog(run, resume_step=1).close()  # a resume drops the lines after its step, in place
        write_json(run / "summary.json", {"steps": 1})
        (run / "train.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
        assert len((run / "records.jsonl").read_text().splitlines()) == 1
        assert json.loads((run / "summary.json").read_text()) == {"steps": 1}
        assert Board.logdirs == ["gs://bucket/run/tensorboard"] * 2
        assert data.load_rows("gs://bucket/run/train.jsonl") == [{"prompt": "1+1?", "answer": "2"}]
        config = base_config()  # the run directory's checks and config history, on gs:// too
        fresh = run / "fresh"
        assert run_dir.prepare(config, fresh) == {}
        for start in (0, 1):
            run_dir.record_config(config, fresh, start, {})
        assert [json.loads(line)["start_step"] for line in (fresh / "config_history.jsonl").read_text().splitlines()
                ] == [0, 1]
        assert run_dir.prepare(config, fresh) == {}  # resumed: the saved config.json is compared (same)
        assert not (REPO / "gs:").exists()
    finally:
        FakeGCS.store.clear()
        FakeGCS.pseudo_dirs[:] = [""]
        registry = importlib.import_module("fsspec.registry")._registry
        for protocol in FakeGCS.protocol:
            registry.pop(protocol, None)
