"""Cost of one code-sandbox call on this machine (host CPU only, no accelerator).

Times `run_outputs` (4 inputs, the vote path) and `passes_tests` without and with the pytest
preload (the GT path), `--repeats` calls each, run one after the other; reports the median wall
time and the median CPU time (this process and its children, the sandbox included) per call, with
the kernel layers active (`sandbox_confinement`). With `--baseline`, another checkout's
`corl_jax/answers/code.py` (e.g. `git worktree add /tmp/base <commit>`) is timed interleaved with
this one, call for call, so that load from other processes hits both alike.

    PYTHONPATH=. python experiments/bench/bench_sandbox.py [--repeats 30] [--baseline /tmp/base/corl_jax/answers/code.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time

from corl_jax.answers import code as code_answers

SOLUTION = "```python\ndef f(xs, k):\n    return sorted(xs)[:k]\n```"
PLAIN_TESTS = "def test_a():\n    assert f([3, 1, 2], 2) == [1, 2]\n"
PYTEST_TESTS = "import pytest\n" + PLAIN_TESTS + (
    "def test_b():\n    with pytest.raises(TypeError):\n        f(None, 1)\n")
INPUTS = [([3, 1, 2], 2), ([], 0), ([5, -1], 1), (("b", "a"), 1)]
CASES = {
    "run_outputs_4_inputs": lambda module: module.run_outputs(
        "def f(xs, k):\n    return sorted(xs)[:k]", "f", INPUTS),
    "passes_tests": lambda module: module.passes_tests(SOLUTION, PLAIN_TESTS),
    "passes_tests_pytest": lambda module: module.passes_tests(SOLUTION, PYTEST_TESTS),
}


def cpu_seconds() -> float:
    return sum(getattr(resource.getrusage(who), field)
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_code", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--baseline", help="code.py of another checkout, timed interleaved")
    parser.add_argument("--out", default="experiments/results/bench_sandbox.json")
    args = parser.parse_args()
    variants = {"this": code_answers}
    if args.baseline:
        variants["baseline"] = load(args.baseline)
    for module in variants.values():
        assert module.passes_tests(SOLUTION, PYTEST_TESTS)  # the timed paths really pass
    figures = {}
    for case, call in CASES.items():
        wall = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 else list(reversed(variants))
            for name in order:
                cpu_start, start = cpu_seconds(), time.perf_counter()
                call(variants[name])
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_seconds() - cpu_start)
        figures[case] = {name: {"wall_ms": round(1e3 * statistics.median(wall[name]), 1),
                                "cpu_ms": round(1e3 * statistics.median(cpu[name]), 1)}
                         for name in variants}
    result = {"command": " ".join(sys.argv), "device": platform.machine(),
              "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "kernel": platform.release(), "uid": os.getuid(),
              "layers": code_answers.sandbox_confinement(), "repeats": args.repeats,
              "figures": figures}
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
