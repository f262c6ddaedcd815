"""Issue 6: which warm-start recipes make CPU-cheap demo bases of moderate accuracy.

    python experiments/evidence/demo_recipes.py --out experiments/results/demo_recipes [--only NAME,...] [--parallel 16]

Each candidate (`CANDIDATES`: a family and `demo_bases.Recipe` overrides) is built with
`demo_bases.build_demo_base` in its own subprocess, then measured with `demo_bases.measure_accuracy` (one sample
at T=0.6) on test problems of its training levels. Accuracy after a given number of SFT steps does not depend on
the device (same float32 program), so the GPU can scan the grid; the `cpu-*` candidates are sized for, and timed
on, a 2-core CPU (`build_seconds`). Results: `<out>/recipes.json`, written as candidates finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from corl_jax.demo import arithmetic  # noqa: E402
from corl_jax.demo import bases as demo_bases  # noqa: E402


def _arch(hidden, intermediate, layers, kv_heads=2, head_dim=None) -> dict:
    """HF config fields of a 4-head candidate shape (head_dim None: hidden / heads)."""
    return dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=kv_heads, **({} if head_dim is None else dict(head_dim=head_dim)))


ARCH = {
    "q2_d96L3": _arch(96, 256, 3), "d64L2": _arch(64, 192, 2), "ll_d128L2": _arch(128, 256, 2, kv_heads=1),
    "q3_d80L4": _arch(80, 192, 4, head_dim=32), "d64L4": _arch(64, 192, 4, head_dim=16),
    "d80L4": _arch(80, 192, 4, head_dim=20), "d48L4": _arch(48, 160, 4, head_dim=12),
    "d64L3": _arch(64, 192, 3, head_dim=16), "d56L4": _arch(56, 168, 4, head_dim=14),
    "d96L3": _arch(96, 256, 3, head_dim=24),
}
BPE_1 = dict(tokenizer="bpe", vocab_size=640, digit_group=1)
BPE_3 = dict(tokenizer="bpe", vocab_size=1024, digit_group=3)
L23 = dict(levels=(2, 3), word_fraction=0.5, max_value=200)  # the full world's problems at levels 2-3


def _candidates() -> dict[str, tuple[str, dict]]:
    """name -> (family, `demo_bases.Recipe` overrides)."""
    arch_of = {"qwen2": ("q2_d96L3", BPE_1), "llama": ("ll_d128L2", BPE_3), "qwen3": ("q3_d80L4", BPE_1)}
    grid = [("llama", 16, 3000, 3e-3, None), ("llama", 16, 3000, 6e-3, None), ("llama", 16, 3000, 6e-3, 60),
            ("llama", 8, 3000, 3e-3, None), ("qwen2", 16, 3000, 6e-3, None), ("qwen2", 16, 3000, 6e-3, 60),
            ("qwen3", 16, 3000, 6e-3, None), ("qwen3", 16, 3000, 6e-3, 60), ("llama", 32, 2000, 6e-3, None),
            ("qwen2", 32, 2000, 6e-3, None), ("llama", 16, 1500, 1e-2, None), ("qwen2", 16, 1500, 1e-2, None)]
    out = {}
    for family, batch, steps, lr, max_value in grid:
        arch, tok = arch_of[family]
        name = f"{family}-{arch}-b{batch}-s{steps}-lr{lr:g}" + (f"-mv{max_value}" if max_value else "")
        out[name] = (family, dict(architecture=ARCH[arch], batch_size=batch, steps=steps, learning_rate=lr,
                                  **tok, **dict(L23, max_value=max_value or 200)))
    # CPU-sized: expression problems only (shorter sequences), small numbers, batch 32.
    for family, arch, tok, max_value in (("qwen3", "d64L4", BPE_1, 30), ("qwen3", "d64L4", BPE_1, 60),
                                         ("llama", "d64L2", BPE_3, 60)):
        out[f"cpu-{family}-{arch}-mv{max_value}-s1500"] = (family, dict(
            architecture=ARCH[arch], batch_size=32, steps=1500, learning_rate=6e-3, **tok,
            **dict(arithmetic.DEMO_WORLD, max_value=max_value)))
    # Third grid (CPU, demo world): 4-layer models of every family, to lift the weak qwen2/llama bases toward the
    # qwen3 one; each keeps its family's tokenizer and seed from demo_bases.RECIPES.
    for family, arch, steps, lr in (("qwen2", "d64L4", 1500, 3e-3), ("qwen2", "d64L4", 1500, 6e-3),
                                    ("qwen2", "d80L4", 1500, 3e-3), ("llama", "d64L4", 1500, 3e-3),
                                    ("llama", "d64L4", 1500, 6e-3), ("qwen3", "d64L4", 1500, 3e-3), ("qwen3", "d64L4", 1000, 3e-3),
                                    ("qwen3", "d48L4", 1500, 3e-3)):
        out[f"cpu3-{family}-{arch}-s{steps}-lr{lr:g}"] = (family, dict(architecture=ARCH[arch], steps=steps,
                                                                         learning_rate=lr))
    # Fourth grid: strong bases of every family (a ring teaches well only when every teacher's vote is mostly
    # right): 4-layer 64-wide models at lr 3e-3 with other seeds and longer runs; accuracy jumps between seeds.
    for family, seed, steps in (("qwen2", 11, 1500), ("qwen2", 12, 1500), ("qwen2", 1, 2000), ("llama", 21, 1500),
                                ("llama", 2, 2000), ("llama", 22, 2000), ("qwen3", 3, 1500), ("qwen3", 31, 1500)):
        out[f"cpu4-{family}-seed{seed}-s{steps}"] = (family, dict(architecture=ARCH["d64L4"], steps=steps,
                                                                  learning_rate=3e-3, seed=seed))
    # Fifth grid: a size per family (Qwen2 > Llama > Qwen3, as in the paper's ring) and a third tokenizer (a
    # 300-token BPE with single digits for Qwen3: fewer merges than Qwen2's saturated 369), cheaper to build.
    fifth = [("qwen3", "d48L4", dict(vocab_size=300), seed) for seed in (3, 31, 32, 33, 34, 35)]
    fifth += [("qwen3", "d48L4", {}, 3)]  # the size change alone
    fifth += [("llama", "d64L3", {}, seed) for seed in (21, 2, 22, 23)]
    fifth += [("llama", "d56L4", {}, seed) for seed in (21, 22, 23)]
    for family, arch, tok, seed in fifth:
        out[f"cpu5-{family}-{arch}-v{tok.get('vocab_size', 'std')}-seed{seed}"] = (family, dict(
            architecture=ARCH[arch], steps=1500, learning_rate=3e-3, seed=seed, **tok))
    # Sixth grid (the fifth's smaller bases reached 15-47%): Qwen3 keeps its strength but gets a third tokenizer,
    # a GPT-2-style BPE that learns numbers with their leading space (digit_group=0: 480 tokens, ~25% shorter
    # examples), and a shape of its own.
    for arch, seed in (("d64L4", 3), ("d64L4", 31), ("d64L4", 32), ("d96L3", 3), ("d96L3", 31), ("d96L3", 32),
                       ("d80L4", 3), ("d80L4", 31)):
        out[f"cpu6-qwen3-{arch}-gpt2bpe-seed{seed}"] = ("qwen3", dict(
            architecture=ARCH[arch], steps=1500, learning_rate=3e-3, seed=seed, digit_group=0))
    # Seventh grid: sizes of their own without losing the RL-friendly single-digit tokenizer: a 3-layer Qwen3-style
    # base (171k parameters against 222k / 255k), trained for 2000 steps.
    for seed in (3, 31, 32, 33, 34, 35, 36, 37, 38, 39):
        out[f"cpu7-qwen3-d64L3-s2000-seed{seed}"] = ("qwen3", dict(architecture=ARCH["d64L3"], steps=2000,
                                                                  learning_rate=3e-3, seed=seed))
    return out


CANDIDATES = _candidates()
MAX_NEW_TOKENS = 64  # the demo's rollout and eval length (demo-world solutions take up to ~45 tokens)


def run_candidate(name: str, num_test: int, workdir: Path) -> dict:
    """Build and measure one candidate (in this process)."""
    import jax
    import numpy as np

    from corl_jax.answers.math import extract_answer, grade_answer
    from corl_jax.demo import bases as demo_bases

    family, overrides = CANDIDATES[name]
    directory = workdir / name
    record = demo_bases.build_demo_base(directory, family, **overrides)
    recipe = dataclasses.replace(demo_bases.RECIPES[family], **overrides)
    test = arithmetic.generate("test", num_test, **recipe.world)
    correct = demo_bases.measure_accuracy(directory, test, max_new_tokens=MAX_NEW_TOKENS)
    # What a peer's reward is made of: samples at the RL temperature and their majority vote.
    texts = demo_bases.sample_texts(directory, test, temperature=1.0, num_samples=8, max_new_tokens=MAX_NEW_TOKENS)
    sample_correct = [[grade_answer(extract_answer(t), p.answer) for t in row] for row, p in zip(texts, test)]
    majority = demo_bases.majority_correct(texts, test)
    greedy = demo_bases.measure_accuracy(directory, test, temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    return dict(name=name, family=family, overrides=overrides, world=recipe.world,
                accuracy=round(float(correct.mean()), 4), greedy_accuracy=round(float(greedy.mean()), 4),
                t1_accuracy=round(float(np.mean(sample_correct)), 4),
                t1_majority8_accuracy=round(float(majority.mean()), 4), num_test=num_test,
                final_loss=round(record["sft_losses"][-1], 4), build_seconds=record["build_seconds"],
                max_example_tokens=record["max_example_tokens"], device=str(jax.devices()[0].device_kind),
                directory=str(directory), correct="".join("01"[int(c)] for c in correct))  # per test problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/demo_recipes")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(CANDIDATES))
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--num-test", type=int, default=300)
    parser.add_argument("--workdir", default=tempfile.mkdtemp(prefix="demo_recipes_"))
    parser.add_argument("--deadline", type=float, default=3600, help="stop (kill) candidates after this many s")
    parser.add_argument("--cores-per-job", type=int, default=0,
                        help="pin each candidate to its own set of this many CPU cores (taskset; 0: no pinning; "
                             "1: single-threaded on the CPU, as the default builds its bases)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this candidate, print its JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_candidate(args.one, args.num_test, Path(args.workdir))), flush=True)
        return
    unknown = set(args.only) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates {sorted(unknown)}; known: {sorted(CANDIDATES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # One core per candidate builds what the default builds (single-threaded); grids 1-7 ran before this.
    base_env = demo_bases.single_threaded_cpu_env() if args.cores_per_job == 1 else os.environ
    env = dict(base_env, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    payload = dict(command=" ".join(sys.argv), results=[], errors={})

    start = time.time()

    free_cores = queue.Queue()
    for slot in range(args.parallel):
        free_cores.put(list(range(slot * args.cores_per_job, (slot + 1) * args.cores_per_job)))

    def launch(name):
        cores = free_cores.get()
        pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
        try:
            proc = subprocess.run([*pin, sys.executable, __file__, f"--one={name}", f"--num-test={args.num_test}",
                                   f"--workdir={args.workdir}"], capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=max(args.deadline - (time.time() - start), 1))
        except subprocess.TimeoutExpired:
            return name, dict(error=f"killed at the {args.deadline:.0f} s deadline")
        finally:
            free_cores.put(cores)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            return name, dict(error=proc.stderr[-1500:])
        return name, dict(json.loads(lines[-1][len("RESULT "):]), wall_seconds=round(time.time() - start, 1))

    with ThreadPoolExecutor(args.parallel) as pool:
        for future in as_completed([pool.submit(launch, name) for name in args.only]):
            name, result = future.result()
            if "error" in result:
                payload["errors"][name] = result["error"]
            else:
                payload["results"].append(result)
            print(name, {k: result.get(k) for k in ("accuracy", "final_loss", "build_seconds", "error")}, flush=True)
            (out / "recipes.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
