"""Soak test of multi-process CPU training: the 2 x 4 packed tiny ring3 run of tests/test_multiprocess.py, repeated.

Each run trains `--steps` steps in 2 local processes x 4 CPU devices (gloo), every checkpoint step saved, with a cold
compilation cache of its own; `--parallel` runs go at once (load, as in the 2-worker CI). A run whose processes use
under 1 CPU-second in `--stall` seconds is a hang: its processes get SIGABRT (PYTHONFAULTHANDLER prints their Python stacks into
the run's logs) after `gdb` (if installed) has written every thread's native stack next to them. The JSON lists each
run (seconds, steps done, hang or exit codes) with the command, machine and versions.

    python experiments/bench/multihost_soak.py --runs 4 --parallel 2 --steps 16 --out experiments/results/multihost_soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from cpu_flags import session_xla_flags  # noqa: E402  (the test session's XLA:CPU flags)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _launch(workdir: Path, steps: int) -> list[subprocess.Popen]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1",
           "XLA_FLAGS": re.sub(r"device_count=\d+", "device_count=4", session_xla_flags("")),
           "JAX_COMPILATION_CACHE_DIR": str(workdir / "compilation_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    cmd = [sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py:tiny", f"--workdir={workdir / 'run'}",
           f"--config.train.max_steps={steps}", "--config.train.save_every=1", f"--config.train.eval_every={steps}",
           "--config.train.eval_on_start=False", "--config.rollout.max_new_tokens=8", "--config.mesh.data=-1",
           "--config.placement=shared", "--config.grpo.packing=True", "--config.grpo.length_bucket=64",
           f"--coordinator_address=localhost:{_port()}", "--num_processes=2"]
    return [subprocess.Popen(cmd + [f"--process_id={i}"], cwd=REPO, env=env, stderr=subprocess.STDOUT,
                             stdout=(workdir / f"process_{i}.log").open("w")) for i in range(2)]


def _steps_done(workdir: Path) -> int:
    """The last training step logged (metrics.jsonl also holds eval rows under their step)."""
    metrics = workdir / "run" / "metrics.jsonl"
    return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0) \
        if metrics.exists() else 0


def _dump_and_abort(workdir: Path, procs: list[subprocess.Popen]) -> None:
    if shutil.which("gdb"):
        for i, p in enumerate(procs):
            with (workdir / f"process_{i}.native_stacks.txt").open("w") as f:
                subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "set pagination off", "-ex",
                                "thread apply all bt 30"], stdout=f, stderr=subprocess.STDOUT, timeout=300)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
    time.sleep(10)
    for p in procs:
        if p.poll() is None:
            p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--stall", type=float, default=120.0,
                        help="seconds with under 1 s of CPU use (both processes together): a hang")
    parser.add_argument("--workdir", default="/tmp/multihost_soak")
    parser.add_argument("--out", default="experiments/results/multihost_soak.json")
    args = parser.parse_args()

    base = Path(args.workdir)
    shutil.rmtree(base, ignore_errors=True)
    results, pending = [], list(range(args.runs))
    active: dict[int, dict] = {}
    while pending or active:
        while pending and len(active) < args.parallel:
            i = pending.pop(0)
            workdir = base / f"run_{i}"
            workdir.mkdir(parents=True)
            active[i] = {"procs": _launch(workdir, args.steps), "workdir": workdir, "start": time.time(),
                         "cpu": 0.0, "idle_since": time.time()}
        time.sleep(5)
        for i, run in list(active.items()):
            procs, now = run["procs"], time.time()
            cpu = sum(_cpu_seconds(p.pid) for p in procs)
            if cpu - run["cpu"] >= 1.0:  # a hung process still ticks (heartbeats, gloo's poll loop): ~0.1 s a minute
                run["cpu"], run["idle_since"] = cpu, now
            hung = all(p.poll() is None for p in procs) and now - run["idle_since"] > args.stall
            if hung:
                _dump_and_abort(run["workdir"], procs)
            if hung or all(p.poll() is not None for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                results.append({"run": i, "seconds": round(now - run["start"], 1),
                                "steps_done": _steps_done(run["workdir"]), "hung": hung,
                                "exit_codes": [p.returncode for p in procs]})
                print(json.dumps(results[-1]), flush=True)
                del active[i]

    import jax
    out = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
           "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "setup": f"2 processes x 4 CPU devices, ring3:tiny shared placement, packed update, {args.steps} steps, "
                    f"{args.parallel} runs at once, cold compilation cache per run",
           "runs": sorted(results, key=lambda r: r["run"]),
           "hangs": sum(r["hung"] for r in results),
           "clean_exits": sum(r["exit_codes"] == [0, 0] for r in results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['hangs']} hung, {out['clean_exits']} of {len(results)} exited 0 -> {args.out}")


if __name__ == "__main__":
    main()
