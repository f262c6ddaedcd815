"""Wall-clock cost of one code-sandbox call on this machine (host CPU only, no accelerator).

Times `run_outputs` (4 inputs, the vote path) and `passes_tests` without and with the pytest
preload (the GT path), each run sequentially `--repeats` times; prints and saves the median and
mean seconds per call with the kernel layers active (`sandbox_confinement`).

    PYTHONPATH=. python experiments/bench_sandbox.py [--repeats 20] [--out experiments/results/bench_sandbox.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from corl_jax.answers import code as code_answers

SOLUTION = "```python\ndef f(xs, k):\n    return sorted(xs)[:k]\n```"
PLAIN_TESTS = "def test_a():\n    assert f([3, 1, 2], 2) == [1, 2]\n"
PYTEST_TESTS = "import pytest\n" + PLAIN_TESTS + (
    "def test_b():\n    with pytest.raises(TypeError):\n        f(None, 1)\n")
INPUTS = [([3, 1, 2], 2), ([], 0), ([5, -1], 1), (("b", "a"), 1)]


def timed(fn, repeats: int) -> dict:
    fn()  # warm the page cache
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {"median_s": statistics.median(seconds), "mean_s": statistics.fmean(seconds)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="experiments/results/bench_sandbox.json")
    args = parser.parse_args()
    assert code_answers.passes_tests(SOLUTION, PYTEST_TESTS)  # the timed paths really pass
    figures = {
        "run_outputs_4_inputs": timed(
            lambda: code_answers.run_outputs(SOLUTION.split("\n", 1)[1].rsplit("```", 1)[0],
                                             "f", INPUTS), args.repeats),
        "passes_tests": timed(lambda: code_answers.passes_tests(SOLUTION, PLAIN_TESTS),
                              args.repeats),
        "passes_tests_pytest": timed(lambda: code_answers.passes_tests(SOLUTION, PYTEST_TESTS),
                                     args.repeats),
    }
    result = {"command": " ".join(sys.argv), "device": platform.processor() or platform.machine(),
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
