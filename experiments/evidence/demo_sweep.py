"""Issue 6 evidence: Co-RL topologies and baselines on the arithmetic world's demo bases, several seeds each.

    python experiments/evidence/demo_sweep.py --out experiments/results/demo_sweep [--seeds 0,1,2] [--parallel 8]

1. Builds the three `demo:<family>` bases (one process each) and measures each one's test accuracy (T=0.6) twice,
   with two sampling seeds, for the Cohen's kappa of per-problem correctness between every pair of bases (a base
   against its own second sample for the same-family pair).
2. Trains every (condition, seed) with `python -m corl_jax.train --config=configs/<file>.py:<variant>` in parallel
   subprocesses, seed-major (every condition's seed 0 before any seed 1), until `--deadline` seconds have passed.
3. Writes `sweep.json` (bases, kappas, per run: each agent's family and initial/final/best eval accuracy, and the
   per-step reward and completion-length curves; per condition: mean gain with a 95% t-interval over seeds) after
   every finished run, and PNG plots at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import scipy.stats

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen2", "llama", "qwen3")
# name -> (config file, overrides with {variant} filled in); a pair's agents are (qwen25, llama32) in
# pair_different_family.py.
CONDITIONS = {
    "ring3": ("ring3", []),
    "pair_qwen2_llama": ("pair_different_family", []),
    "pair_same_qwen2": ("pair_same_family", []),
    "ttrl_qwen2": ("ttrl", []),
    "gt_reward_qwen2": ("gt_reward", []),
    "pair_qwen2_qwen3": ("pair_different_family", ["--config.agents.llama32.model_path={variant}:qwen3"]),
    "pair_llama_qwen3": ("pair_different_family", ["--config.agents.qwen25.model_path={variant}:llama",
                                                   "--config.agents.llama32.model_path={variant}:qwen3"]),
    "different_family_plus": ("different_family_plus", []),  # the rephrasings in symbols (operands commuted)
    # ... with the spoken rephrasings ("minus", "times"), which the bases never saw
    "different_family_plus_spoken": ("different_family_plus", ["--config.data.train_path={spoken_train}",
                                                               "--config.data.eval_path={spoken_eval}"]),
    # the ring with a larger step for the Llama-style agent only (it does not gain at the shared 3e-5)
    "ring3_llama_lr1e-4": ("ring3", ["--config.agents.llama32.learning_rate=1e-4"]),
    "ring3_llama_lr3e-4": ("ring3", ["--config.agents.llama32.learning_rate=3e-4"]),
}


def mean_ci(values) -> dict:
    """Mean and the half-width of its 95% t-interval (None with fewer than 2 values)."""
    v = np.asarray(values, float)
    half = float(scipy.stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
    return dict(mean=round(float(v.mean()), 4), ci95=None if half is None else round(half, 4), n=len(v))


def run_jobs(jobs: list, run, parallel: int, may_start, payload: dict, aggregate, save) -> None:
    """Runs `run(*job)` for the `jobs` in order, `parallel` at a time, starting one only while `may_start()`; after
    each finished run appends its result to `payload["runs"]`, refreshes `payload["summary"]` with `aggregate`, prints
    its headline and calls `save`. The jobs never started are left in `jobs`."""
    with ThreadPoolExecutor(parallel) as pool:
        pending = set()
        while jobs or pending:
            while jobs and len(pending) < parallel and may_start():
                pending.add(pool.submit(run, *jobs.pop(0)))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                payload["runs"].append(future.result())
                payload["summary"] = aggregate(payload["runs"])
                r = payload["runs"][-1]
                keys = ("condition", "seed", "seconds", "agents", "error")
                print(json.dumps({k: r.get(k) for k in keys}), flush=True)
                save()


def merged_payload(specs: list[str], aggregate, keys: tuple[str, ...]) -> dict:
    """One sweep payload from the runs of several sweep JSON files (seeds or conditions run by separate commands or
    on other machines). A spec is FILE, or FILE:COND,COND for only those conditions' runs. Each run keeps its file
    and device; each of `keys` comes from the first file that has it; `aggregate` recomputes the summary."""
    files = [spec.partition(":") for spec in specs]
    parts = [json.loads(Path(f).read_text()) for f, _, _ in files]
    runs = [dict(r, device=r.get("device", p.get("device")), sweep=f) for (f, _, keep), p in zip(files, parts)
            for r in p["runs"] if not keep or r["condition"] in keep.split(",")]
    merged = [dict(file=f, conditions=keep or "all", command=p["command"], device=p.get("device"),
                   note=p.get("note", "")) for (f, _, keep), p in zip(files, parts)]
    return dict(command=" ".join(sys.argv), merged=merged, runs=runs, summary=aggregate(runs),
                **{key: next((p[key] for p in parts if p.get(key) is not None), None) for key in keys})


def measure_bases(num_test: int) -> dict:
    """Each base's test accuracy (two sampling seeds) and the kappa of per-problem correctness between bases."""
    from corl_jax.demo import arithmetic
    from corl_jax.demo import bases as demo_bases
    from corl_jax.voting import cohens_kappa

    test = arithmetic.generate("test", num_test, **arithmetic.DEMO_WORLD)
    correct = {(f, s): demo_bases.measure_accuracy(demo_bases.demo_base_dir(f), test, seed=s)
               for f in FAMILIES for s in (0, 1)}
    kappa = {f"{a}-{b}": round(float(cohens_kappa(correct[a, 0], correct[b, 1 if a == b else 0])), 4)
             for i, a in enumerate(FAMILIES) for b in FAMILIES[i:]}
    return dict(num_test=num_test, accuracy={f: round(float(correct[f, 0].mean()), 4) for f in FAMILIES},
                kappa=kappa)


def run_one(condition: str, seed: int, args, env) -> dict:
    """One training run in a subprocess; its summary and per-step curves."""
    from corl_jax.config import variant_sources

    config_file, overrides = CONDITIONS[condition]
    spoken = variant_sources(args.variant, rephrasing="words")
    workdir = Path(args.workdirs) / f"{condition}-s{seed}"
    command = [sys.executable, "-m", "corl_jax.train", f"--config={REPO}/configs/{config_file}.py:{args.variant}",
               f"--workdir={workdir}", f"--config.seed={seed}", f"--config.data_seed={seed}",
               *(o.format(variant=args.variant, spoken_train=spoken[0], spoken_eval=spoken[1]) for o in overrides),
               *args.override]
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    result = dict(condition=condition, seed=seed, seconds=round(time.time() - start, 1), command=" ".join(command[1:]))
    if proc.returncode != 0:
        return dict(result, error=proc.stderr[-1500:])
    summary = json.loads((workdir / "summary.json").read_text())
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    agents = json.loads((workdir / "config.json").read_text())["agents"]
    families = {name: spec["model_path"].split(":")[-1] for name, spec in agents.items()}  # "<variant>:<family>"
    curves = {}
    for name in summary["agents"]:
        curves[name] = {key: [[r["step"], round(r[f"{name}/{key}"], 4)] for r in rows if f"{name}/{key}" in r]
                        for key in ("eval_reward", "reward", "completions/mean_length")}
    return dict(result, agents=summary["agents"], families=families, curves=curves)


def aggregate(runs: list[dict]) -> dict:
    """Per condition: each agent's and the agents' mean gain (final - initial eval accuracy) over seeds."""
    out = {}
    for condition in CONDITIONS:
        done = [r for r in runs if r["condition"] == condition and "agents" in r]
        if not done:
            continue
        names = list(done[0]["agents"])
        gain = lambda r, n, key="final_accuracy": r["agents"][n][key] - r["agents"][n]["initial_accuracy"]  # noqa: E731
        out[condition] = dict(
            seeds=[r["seed"] for r in done],
            agents={n: dict(family=done[0]["families"].get(n, ""),
                            initial=mean_ci([r["agents"][n]["initial_accuracy"] for r in done]),
                            final=mean_ci([r["agents"][n]["final_accuracy"] for r in done]),
                            gain=mean_ci([gain(r, n) for r in done]),
                            best_gain=mean_ci([gain(r, n, "best_accuracy") for r in done])) for n in names},
            mean_gain=mean_ci([np.mean([gain(r, n) for n in names]) for r in done]))
    return out


def plot(payload: dict, out: Path) -> list[str]:
    """gains.png (mean gain per condition and agent, 95% CI) and stability.png (reward and completion length
    per step, mean over seeds, for each condition's first agent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    summary = payload["summary"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels, positions, x = [], [], 0
    for condition, s in summary.items():
        for name, a in s["agents"].items():
            ax.bar(x, a["gain"]["mean"], yerr=a["gain"]["ci95"] or 0, capsize=3, color=f"C{FAMILIES.index(a['family'])}"
                   if a["family"] in FAMILIES else "grey")
            labels.append(f"{condition}\n{a['family'] or name}")
            positions.append(x)
            x += 1
        x += 0.5
    ax.set_xticks(positions, labels, rotation=60, fontsize=7, ha="right")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("eval accuracy gain (final - base)")
    ax.set_title("demo world: gain over the base per agent, mean and 95% CI over seeds (command: sweep.json)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gains.png", dpi=120)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for condition in summary:
        runs = [r for r in payload["runs"] if r["condition"] == condition and "curves" in r]
        name = next(iter(runs[0]["curves"]))
        for ax, key in zip(axes, ("eval_reward", "reward", "completions/mean_length")):
            series = [dict(map(tuple, r["curves"][name][key])) for r in runs]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            ax.plot(steps, [np.mean([s[t] for s in series]) for t in steps], label=condition)
            ax.set_title(f"{key} ({runs[0]['families'].get(name, name)} agent, mean over seeds)", fontsize=8)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "stability.png", dpi=120)
    return ["gains.png", "stability.png"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/demo_sweep")
    parser.add_argument("--conditions", type=lambda s: s.split(","), default=list(CONDITIONS))
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=3600, help="start no run after this many seconds")
    parser.add_argument("--variant", default="demo")
    parser.add_argument("--num-test", type=int, default=500, help="test problems for the bases' kappa")
    parser.add_argument("--override", action="append", default=[], help="extra --config.* flag for every run")
    parser.add_argument("--workdirs", default=tempfile.mkdtemp(prefix="demo_sweep_"))
    parser.add_argument("--replot", action="store_true", help="only redraw the plots of <out>/sweep.json")
    parser.add_argument("--merge", nargs="+", default=[],
                        help="sweep.json files (e.g. seeds run on different machines) whose runs make "
                             "<out>/sweep.json; FILE:COND,COND takes only those conditions' runs from FILE; "
                             "the bases of the first file that has them are kept")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        payload = merged_payload(args.merge, aggregate, keys=("bases",))
        payload["plots"] = plot(payload, out)
        (out / "sweep.json").write_text(json.dumps(payload, indent=1) + "\n")
        print(json.dumps(payload["summary"], indent=1))
        return
    if args.replot:
        payload = json.loads((out / "sweep.json").read_text())
        payload["plots"] = plot(payload, out)
        (out / "sweep.json").write_text(json.dumps(payload, indent=1) + "\n")
        return
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # runs share one accelerator
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    start = time.time()
    payload = dict(command=" ".join(sys.argv), runs=[], summary={})
    save = lambda: (out / "sweep.json").write_text(json.dumps(payload, indent=1) + "\n")  # noqa: E731
    if args.variant == "demo":
        from corl_jax.demo.bases import build_all

        build_all(FAMILIES)
        payload["bases"] = measure_bases(args.num_test)
        payload["bases_seconds"] = round(time.time() - start, 1)
        print(json.dumps(payload["bases"]), flush=True)
        save()
    import jax

    payload["device"] = str(jax.devices()[0].device_kind)
    jobs = [(c, s, args, env) for s in args.seeds for c in args.conditions]
    run_jobs(jobs, run_one, args.parallel, lambda: time.time() - start < args.deadline, payload, aggregate, save)
    payload["not_run"] = [f"{c}-s{s}" for c, s, *_ in jobs]
    payload["plots"] = plot(payload, out) if payload["summary"] else []
    save()
    print(json.dumps(payload["summary"], indent=1))


if __name__ == "__main__":
    main()
