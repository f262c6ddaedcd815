"""Issue 6: how long the README's first command takes from an empty cache, and what the machine gave it.

    python experiments/evidence/demo_timing.py --out experiments/results/demo_timing.json [--cores 0,1] [-- --config.X=...]

Runs `python -m corl_jax.train --config=configs/ring3.py:demo` with `CORL_JAX_CACHE` pointing at a new empty
directory (so the three bases are built first, as on a fresh machine), optionally pinned to `--cores` (taskset).
Reads /proc/stat before and after: on a shared virtual machine the hypervisor's steal time inflates the wall clock,
so the JSON records the steal share next to the wall time, the bases' wall time and each one's build seconds (its
`demo_base.json`) and weights hash (bases built on different CPUs may differ in their last bits), the CPU seconds the
run used, and every agent's accuracy before and after. Results are appended to `--out`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_jiffies() -> dict[str, int]:
    """The machine's cumulative CPU time by state (/proc/stat's first line)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), map(int, fields)))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/demo_timing.json")
    parser.add_argument("--cores", help="pin the run to these CPU cores (taskset list, e.g. 0,1)")
    parser.add_argument("--note", default="")
    parser.add_argument("--cache", help="build the bases into this empty directory (default: a new temporary one)")
    parser.add_argument("overrides", nargs="*", help="extra --config.* flags for the run")
    args = parser.parse_args()
    cache, workdir = args.cache or tempfile.mkdtemp(prefix="demo_cache_"), tempfile.mkdtemp(prefix="demo_run_")
    if any(Path(cache).glob("*")):
        raise SystemExit(f"--cache {cache} is not empty: the timing is of a first run, which builds the bases")
    command = [sys.executable, "-m", "corl_jax.train", "--config=configs/ring3.py:demo", f"--workdir={workdir}",
               *args.overrides]
    pin = ["taskset", "-c", args.cores] if args.cores else []
    first, start = cpu_jiffies(), time.time()
    proc = subprocess.run([*pin, *command], env=dict(os.environ, CORL_JAX_CACHE=cache), cwd=REPO)
    wall, last = time.time() - start, cpu_jiffies()
    if proc.returncode:
        raise SystemExit(f"the demo run failed (exit {proc.returncode}); workdir {workdir}")
    delta = {k: last[k] - first[k] for k in first}
    total = sum(delta.values()) or 1
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = sorted(Path(cache, "zoo").glob("demo-*/demo_base.json"))
    bases_wall = max(r.stat().st_mtime for r in records) - start  # bases may be built side by side
    bases = {}
    for record_file in records:
        record = json.loads(record_file.read_text())
        bases[record["family"]] = dict(build_seconds=record["build_seconds"], steps=record["recipe"]["steps"],
                                       architecture=record["recipe"]["architecture"],
                                       final_sft_loss=round(record["sft_losses"][-1], 4),
                                       weights_sha256=hashlib.sha256(
                                           (record_file.parent / "model.safetensors").read_bytes()).hexdigest()[:16])
    summary = json.loads(Path(workdir, "summary.json").read_text())
    result = dict(
        date=time.strftime("%Y-%m-%d %H:%M"), command="CORL_JAX_CACHE=<empty dir> " + " ".join(pin + ["python", *command[1:]]),
        note=args.note, machine=dict(cpu=cpu_model(), cores=len(os.sched_getaffinity(0)), pinned=args.cores,
                                     python=platform.python_version(), jax=importlib.metadata.version("jax")),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip(),
        wall_seconds=round(wall, 1), bases_wall_seconds=round(bases_wall, 1),
        base_build_seconds=round(sum(b["build_seconds"] for b in bases.values()), 1),
        cpu_seconds=round(usage.ru_utime + usage.ru_stime, 1),
        machine_cpu_share={k: round(v / total, 3) for k, v in delta.items() if v},  # all cores, whole run
        bases=bases,
        accuracy={name: dict(before=a["initial_accuracy"], after=a["final_accuracy"])
                  for name, a in summary["agents"].items()})
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if out.exists() else []
    out.write_text(json.dumps(dict(runs=runs + [result]), indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
