"""Issue 22 part 2: a controlled test of the diversity mechanism (docs/diversity.md).

    CORL_JAX_CACHE=$PWD/.cache_diversity python experiments/evidence/diversity_sweep.py --out <dir>/diversity.json \
        [--conditions same_mode,different_mode_prec,ttrl,gt_reward] [--seeds 0,1,2] [--steps 200] [--parallel 8]

The bases (`corl_jax.demo.bases.SLIP_BASES`) share one shape and tokenizer recipe and differ only in seed and in the
systematic slip of their SFT solutions (`corl_jax.demo.arithmetic.slipped_solution`). The student is always
`slip-carry-a`; its peer shares its error mode (`slip-carry-b`) or has another one (`slip-prec`, `slip-sign`).

1. Builds (or finds in `$CORL_JAX_CACHE`) the bases, side by side, and (while step 2 runs) measures each one on
   `--num-test` test problems at T=0.6 with two sampling seeds: accuracy, how often it answers a problem's slipped
   answer where its own slip applies (`designed_error`), and the Cohen's kappa of per-problem correctness between
   every pair (a base against its own second sample on the diagonal). `--bases FILE` reuses such a measurement.
2. Trains every (condition, seed) with `python -m corl_jax.train` in parallel subprocesses, seed-major, starting a
   run only while it is predicted to end within `--budget` seconds (the longest finished run so far, or
   `--run-estimate` before any has finished).
3. Writes the JSON after every finished run: per run each agent's initial/final accuracy and, from records.jsonl,
   how often the student's reward label agreed with the slipped answer or the gold one on the training prompts its
   slip applies to; per condition the student's and the peer's gain with a 95% t-interval over seeds. At the end,
   `gain_vs_kappa.png` next to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_sweep import mean_ci, merged_payload, run_jobs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STUDENT = "slip-carry-a"
BASES = ("slip-carry-a", "slip-carry-b", "slip-prec", "slip-sign")
SLIP_OF = {"slip-carry-a": "carry", "slip-carry-b": "carry", "slip-prec": "precedence", "slip-sign": "sign"}
# name -> (config file, the student's peer or None); the student is agent `qwen25`, its peer `llama32`.
CONDITIONS = {
    "same_mode": ("pair_different_family", "slip-carry-b"),
    "different_mode_prec": ("pair_different_family", "slip-prec"),
    "different_mode_sign": ("pair_different_family", "slip-sign"),
    "ttrl": ("ttrl", None),
    "gt_reward": ("gt_reward", None),
}
AGENTS = ("qwen25", "llama32")


def build_bases(sft_overrides: dict) -> dict[str, Path]:
    """The `BASES` checkpoint directories; missing ones are built side by side, one subprocess each (also on an
    accelerator, shared without preallocation). `sft_overrides`: recipe fields to replace (a smoke test's)."""
    import dataclasses

    from corl_jax.demo import bases as demo_bases
    from corl_jax.demo import checkpoints

    for name in BASES:
        family, recipe = demo_bases.SLIP_BASES[name]
        demo_bases.SLIP_BASES[name] = (family, dataclasses.replace(recipe, **sft_overrides))
    directories = {name: demo_bases._cache_dir(name) for name in BASES}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    children = [subprocess.Popen(demo_bases.build_command(name), env=env, cwd=REPO)
                for name, directory in directories.items() if not checkpoints.is_built(directory)]
    failed = [child.args for child in children if child.wait()]
    if failed:
        raise RuntimeError(f"{len(failed)} base builds failed (their output is above)")
    return directories


def measure_bases(directories: dict[str, Path], num_test: int) -> dict:
    """Each base's accuracy and designed-error rate, and the kappa of per-problem correctness between bases."""
    from corl_jax.answers.math import extract_answer, grade_answer
    from corl_jax.demo import arithmetic
    from corl_jax.demo import bases as demo_bases
    from corl_jax.voting import cohens_kappa

    items = arithmetic.generate_items("test", num_test, **arithmetic.DEMO_WORLD)
    problems = [item.problem(i, "test") for i, item in enumerate(items)]
    slipped = {slip: [slipped_answer(item, slip) for item in items] for slip in arithmetic.SLIPS}
    correct, out = {}, dict(num_test=num_test, accuracy={}, designed_error={}, slip_applies={})
    for slip in arithmetic.SLIPS:
        out["slip_applies"][slip] = round(float(np.mean([a is not None for a in slipped[slip]])), 4)
    for name, directory in directories.items():
        for seed in (0, 1):
            texts = demo_bases.sample_texts(directory, problems, temperature=0.6, num_samples=1, seed=seed,
                                            batch_prompts=len(problems))
            answers = [extract_answer(row[0]) for row in texts]
            correct[name, seed] = np.array([grade_answer(a, p.answer) for a, p in zip(answers, problems)], bool)
            if seed == 0:
                hits = [a == str(s) for a, s in zip(answers, slipped[SLIP_OF[name]]) if s is not None]
                out["designed_error"][name] = _rounded(np.mean(hits) if hits else None)
        out["accuracy"][name] = round(float(correct[name, 0].mean()), 4)
    names = list(directories)
    out["kappa"] = {f"{a}|{b}": _rounded(cohens_kappa(correct[a, 0], correct[b, 1 if a == b else 0]))
                    for i, a in enumerate(names) for b in names[i:]}
    return out


def _rounded(x) -> float | None:
    """x to 4 decimals; None for None or NaN (kappa of a base that is never or always right), for strict JSON."""
    return None if x is None or not np.isfinite(x) else round(float(x), 4)


def slipped_answer(item, slip: str) -> int | None:
    """The answer `item`'s worked solution reaches with `slip`, or None where the slip does not apply."""
    from corl_jax.answers.math import extract_answer
    from corl_jax.demo.arithmetic import slipped_solution

    solution = slipped_solution(item, slip)
    return None if solution is None else int(extract_answer(solution))


def label_agreement(records_path: Path, agent: str, slip: str, train_items) -> dict:
    """On the training prompts where `slip` applies: the share of `agent`'s reward labels (its teacher's vote) and
    of its own votes that are the slipped answer or the gold one, over the run's first and last quarter of steps;
    and `no_signal`, the share of those prompts whose G rewards are all equal (GRPO's advantage is zero there)."""
    rows = [json.loads(line) for line in records_path.read_text().splitlines()]
    rows = [r for r in rows if r["agent"] == agent]
    slipped = {}
    for r in rows:
        if r["prompt_id"] not in slipped:
            slipped[r["prompt_id"]] = slipped_answer(train_items[r["prompt_id"]], slip)
    rows = [r for r in rows if slipped[r["prompt_id"]] is not None]
    if not rows:
        return {}
    steps = sorted({r["step"] for r in rows})
    quarter = max(1, len(steps) // 4)
    out = dict(prompts=len(rows))
    for part, keep in (("first", set(steps[:quarter])), ("last", set(steps[-quarter:]))):
        part_rows = [r for r in rows if r["step"] in keep]
        for field in ("teacher_label", "label"):
            out[f"{field}_slipped_{part}"] = round(float(np.mean(
                [r[field] == str(slipped[r["prompt_id"]]) for r in part_rows])), 4)
            out[f"{field}_gold_{part}"] = round(float(np.mean([r[field] == r["gt"] for r in part_rows])), 4)
        out[f"no_signal_{part}"] = round(float(np.mean([len(set(r["rewards"])) == 1 for r in part_rows])), 4)
    return out


def run_one(condition: str, seed: int, args, env, directories: dict[str, Path], train_items) -> dict:
    """One training run in a subprocess; its summary and the student's label agreement on its slip's prompts."""
    config_file, peer = CONDITIONS[condition]
    workdir = Path(args.workdirs) / f"{condition}-s{seed}"
    bases = [STUDENT] + ([peer] if peer else [])
    agents = [f"--config.agents.{agent}.{key}={value}" for agent, base in zip(AGENTS, bases)
              for key, value in (("model_path", directories[base]), ("family", "qwen3"))]
    steps = args.steps
    command = [sys.executable, "-m", "corl_jax.train", f"--config={REPO}/configs/{config_file}.py:demo",
               f"--workdir={workdir}", f"--config.seed={seed}", f"--config.data_seed={seed}", *agents,
               f"--config.train.max_steps={steps}", f"--config.train.eval_every={steps}",
               f"--config.train.save_every={steps}", f"--config.data.max_eval_samples={args.eval_problems}",
               *args.override]
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    result = dict(condition=condition, seed=seed, bases=dict(zip(AGENTS, bases)),
                  seconds=round(time.time() - start, 1), command=" ".join(command[1:]))
    if proc.returncode != 0:
        return dict(result, error=proc.stderr[-1500:])
    summary = json.loads((workdir / "summary.json").read_text())
    labels = label_agreement(workdir / "records.jsonl", AGENTS[0], SLIP_OF[STUDENT], train_items)
    return dict(result, agents=summary["agents"], student_labels=labels)


def aggregate(runs: list[dict]) -> dict:
    """Per condition: the student's and the peer's gain (final - initial eval accuracy) over seeds, and the
    student's label agreement on its slip's training prompts."""
    out = {}
    for condition in CONDITIONS:
        done = [r for r in runs if r["condition"] == condition and "agents" in r]
        if not done:
            continue
        gain = lambda r, n: r["agents"][n]["final_accuracy"] - r["agents"][n]["initial_accuracy"]  # noqa: E731
        entry = dict(seeds=[r["seed"] for r in done], peer=CONDITIONS[condition][1],
                     student_initial=mean_ci([r["agents"][AGENTS[0]]["initial_accuracy"] for r in done]),
                     student_gain=mean_ci([gain(r, AGENTS[0]) for r in done]))
        if AGENTS[1] in done[0]["agents"]:
            entry["peer_gain"] = mean_ci([gain(r, AGENTS[1]) for r in done])
        keys = sorted(set.intersection(*(set(r["student_labels"]) for r in done)) - {"prompts"})
        entry["student_labels"] = {k: mean_ci([r["student_labels"][k] for r in done]) for k in keys}
        out[condition] = entry
    return out


def plot(payload: dict, path: Path) -> str | None:
    """The student's gain (95% CI) against the kappa between it and its teacher: its peer's base in a pair, its
    own second sample for TTRL; GT-Reward as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return None
    kappa = (payload.get("bases") or {}).get("kappa", {})
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, (condition, s) in enumerate(payload["summary"].items()):
        g = s["student_gain"]
        if condition == "gt_reward":
            ax.axhline(g["mean"], color="grey", ls="--", label=f"gt_reward ceiling ({g['n']} seeds)")
            continue
        teacher = s["peer"] or STUDENT
        k = kappa.get(f"{STUDENT}|{teacher}", kappa.get(f"{teacher}|{STUDENT}"))
        if k is None:
            continue
        ax.errorbar(k, g["mean"], yerr=g["ci95"] or 0, fmt="o", capsize=4, color=f"C{i}",
                    label=f"{condition} ({g['n']} seeds)")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel(f"kappa of per-problem correctness, {STUDENT} vs its teacher")
    ax.set_ylabel(f"{STUDENT} eval accuracy gain (final - base)")
    ax.set_title("controlled diversity test: gain vs error overlap (mean, 95% CI)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.parent / "gain_vs_kappa.png"
    fig.savefig(out, dpi=120)
    return out.name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/diversity/diversity.json")
    parser.add_argument("--conditions", type=lambda s: s.split(","), default=list(CONDITIONS))
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--eval-problems", type=int, default=500, help="test problems of the before/after eval")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--budget", type=float, default=3600,
                        help="start a run only while it is predicted to end within this many seconds")
    parser.add_argument("--run-estimate", type=float, default=300, help="a run's seconds until one has finished")
    parser.add_argument("--num-test", type=int, default=500, help="test problems of the bases' measurement")
    parser.add_argument("--bases", help="a JSON file whose 'bases' measurement to reuse instead of measuring")
    parser.add_argument("--sft-steps", type=int, help="override the bases' SFT steps (smoke tests; other bases)")
    parser.add_argument("--sft-examples", type=int, help="override the bases' SFT problems (smoke tests)")
    parser.add_argument("--slip-rate", type=float,
                        help="override the bases' slip rate: the share of the problems a slip applies to whose SFT "
                             "solution slips (default: the recipes' 1.0, every one)")
    parser.add_argument("--override", action="append", default=[], help="extra --config.* flag for every run")
    parser.add_argument("--workdirs", default=tempfile.mkdtemp(prefix="diversity_sweep_"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plot of --out")
    parser.add_argument("--merge", nargs="+", default=[],
                        help="diversity JSON files (e.g. seeds run by separate commands) whose runs make --out; "
                             "FILE:COND,COND takes only those conditions' runs; the first bases measurement is kept")
    args = parser.parse_args(argv)
    if args.slip_rate is not None and not 0 < args.slip_rate <= 1:
        parser.error(f"--slip-rate must be in (0, 1]; got {args.slip_rate}")
    if args.merge or args.replot:
        payload = merged_payload(args.merge, aggregate, keys=("bases", "base_dirs", "student", "steps")) \
            if args.merge else json.loads(Path(args.out).read_text())
        payload["plot"] = plot(payload, Path(args.out))
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
        return
    unknown = sorted(set(args.conditions) - set(CONDITIONS))
    if unknown:
        parser.error(f"unknown conditions {unknown}; use some of {sorted(CONDITIONS)}")
    start = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(command=" ".join(sys.argv), cache=os.environ.get("CORL_JAX_CACHE"), student=STUDENT,
                   steps=args.steps, slip_rate=1.0 if args.slip_rate is None else args.slip_rate, runs=[], summary={})
    save = lambda: out.write_text(json.dumps(payload, indent=1) + "\n")  # noqa: E731
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # runs share one accelerator
    from corl_jax.demo import arithmetic

    overrides = {k: v for k, v in (("steps", args.sft_steps), ("num_examples", args.sft_examples),
                                   ("slip_rate", args.slip_rate)) if v is not None}
    directories = build_bases(overrides)
    payload["base_dirs"] = {name: d.name for name, d in directories.items()}
    payload["bases_seconds"] = round(time.time() - start, 1)
    if args.bases:
        payload["bases"] = json.loads(Path(args.bases).read_text())["bases"]
        payload["bases_from"] = args.bases
    save()
    import jax

    payload["device"] = str(jax.devices()[0].device_kind)
    train_items = arithmetic.generate_items("rl", arithmetic.DEFAULT_SIZES["rl"], **arithmetic.DEMO_WORLD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    jobs = [(c, s, args, env, directories, train_items) for s in args.seeds for c in args.conditions]

    def may_start() -> bool:  # predicted to end within the budget: as long as the longest finished run so far
        longest = max((r["seconds"] for r in payload["runs"]), default=args.run_estimate)
        return time.time() - start + longest < args.budget

    with ThreadPoolExecutor(1) as side:
        # the bases are measured in this process while the runs train
        measuring = side.submit(measure_bases, directories, args.num_test) if args.num_test and not args.bases \
            else None
        run_jobs(jobs, run_one, args.parallel, may_start, payload, aggregate, save)
        if measuring:
            payload["bases"] = measuring.result()
            print(json.dumps(payload["bases"]), flush=True)
    payload["not_run"] = [f"{c}-s{s}" for c, s, *_ in jobs]
    payload["seconds"] = round(time.time() - start, 1)
    payload["plot"] = plot(payload, out) if payload["summary"] else None
    save()
    print(json.dumps(payload["summary"], indent=1))

if __name__ == "__main__":
    main()
