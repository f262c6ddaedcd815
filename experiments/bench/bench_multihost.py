"""Host cost of the labels of one ring3 step on several processes: 3 agents × 16 prompts × 8 completions.

What a multi-process run pays per step for its labels (corl_jax/multihost.py, docs/multihost.md):
  gather     every process reads each agent's completion tokens [128, T] (batch-sharded over all processes) with
             `multihost.to_host` (process_allgather): the texts every process decodes;
  labels     process 0 alone extracts, normalises, votes and grades (`voting.score_step`, cold caches, the
             completions of experiments/bench/bench_answers.py);
  broadcast  process 0's rewards [3, 16, 8] float32 reach every process (`multihost.broadcast`).
It starts `--processes` local processes (CPU devices, gloo collectives) and saves the medians as JSON.

    PYTHONPATH=. python experiments/bench/bench_multihost.py [--processes 2] [--devices 4] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from corl_jax import multihost, voting
    from corl_jax.answers import math as math_answers

    multihost.initialize(f"localhost:{args.port}", args.processes, args.worker)
    sys.path.insert(0, HERE)
    from bench_answers import make_step

    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices(),
                         axis_types=(jax.sharding.AxisType.Auto,))
    tokens = jax.device_put(np.arange(128 * args.tokens, dtype=np.int32).reshape(128, args.tokens),
                            NamedSharding(mesh, PartitionSpec("data")))
    gather, labels, broadcast = [], [], []
    for i in range(args.repeats + 1):  # the first round (compilation, sympy workers' start) is not measured
        t0 = time.perf_counter()
        multihost.to_host([tokens] * 3)
        t1 = time.perf_counter()
        if multihost.is_main():
            texts, gt, ids = make_step(args.seed + i)
            math_answers.clear_caches()
            grader = voting.PairGrader(math_answers.grade_answer, grade_many=math_answers.grade_answers)
            rewards = voting.score_step(texts, gt, topology="ring", threshold=0.0, grader=grader,
                                        extract=math_answers.extract_answer, normalize=math_answers.normalize_answer,
                                        step=i, prompt_ids=ids).rewards
        else:
            rewards = np.zeros((3, 16, 8), np.float32)
        t2 = time.perf_counter()
        multihost.broadcast(rewards)
        t3 = time.perf_counter()
        if i:
            gather.append(t1 - t0), labels.append(t2 - t1), broadcast.append(t3 - t2)
    ms = lambda xs: round(1000 * statistics.median(xs), 2)
    out = {"process": args.worker, "gather_tokens_3_agents_ms": ms(gather), "broadcast_rewards_ms": ms(broadcast)}
    if multihost.is_main():
        out["labels_score_step_cold_ms"] = ms(labels)
    with open(os.path.join(args.tmp, f"{args.worker}.json"), "w") as f:
        json.dump(out, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
    parser.add_argument("--tokens", type=int, default=1024, help="completion length T of the gathered tokens")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "..", "results", "bench_multihost.json"))
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args)

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        base = [sys.executable, __file__, f"--processes={args.processes}", f"--devices={args.devices}",
                f"--tokens={args.tokens}", f"--repeats={args.repeats}", f"--seed={args.seed}", f"--port={port}",
                f"--tmp={tmp}"]
        procs = [subprocess.Popen(base + [f"--worker={i}"]) for i in range(args.processes)]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            sys.exit(f"a worker failed (exit codes {codes})")
        per_process = [json.load(open(os.path.join(tmp, f"{i}.json"))) for i in range(args.processes)]

    import jax
    import numpy as np

    result = {
        "command": " ".join(["PYTHONPATH=.", os.path.basename(sys.executable)] + sys.argv),
        "device": {"cpu_count": os.cpu_count(), "machine": platform.machine(),
                   "processes": args.processes, "cpu_devices_per_process": args.devices, "collectives": "gloo",
                   "load_average_1_5_15min_before": [round(x, 2) for x in load_before],
                   "load_average_1_5_15min_after": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__},
        "config": {"agents": 3, "prompts": 16, "G": 8, "completion_tokens": args.tokens, "repeats": args.repeats},
        "per_process_median_ms": per_process,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
