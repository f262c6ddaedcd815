"""Issue 22 part 1: the real SmolLM2-135M-Instruct trained by GT-Reward, TTRL and Co-RL pairs, several seeds each.

    python experiments/evidence/smollm2_sweep.py --out $OUT [--parts build/smollm2/part0.npz build/smollm2/part1.npz]
        [--conditions gt_reward,ttrl,pair_demo,pair_same] [--seeds 0,1,2] [--parallel 12] [--time-limit 540]

1. Makes the SmolLM2 checkpoint directory: from `--parts` (`smollm2.pack_parts`'s files, for a machine without
   network) or by `smollm2.smollm2_hf_dir()`. Starts building `demo:qwen3` (the pair partner) in a child process.
2. With `--pick-world` (default), measures the base's accuracy on the candidate worlds (`--worlds`, test split) and
   MATH-500 with experiments/evidence/smollm2_base.py (<out>/base_accuracy.json), and trains on the world whose
   mean T=1 accuracy lies in [0.15, 0.6], a symbolic one first (the partner reads only symbols), then nearest 0.35;
   none in range: the one it scores best on (on the 2-core CPU it scored 1/16 on levels 2, numbers up to 20).
3. Trains every (condition, seed) with `python -m corl_jax.train --config=configs/smollm2.py:<condition>` in
   parallel child processes on one device (no memory preallocation), seed-major; pair_demo runs start once the
   partner is built. Runs still going at `--time-limit` seconds are stopped and keep what they logged.
4. Writes `<out>/smollm2_sweep.json` after every finished run: per run and agent, the base and final eval accuracy
   and per-step curves of the eval accuracy, training reward, mean completion length, EOS rate (1 - clipped ratio)
   and the sampler-vs-trainer log-prob gap (metrics.jsonl's sampling/* entries); per condition and agent, mean and
   95% t-interval over seeds of base, final, gain, and the run means of reward, length, EOS rate and log-prob gap.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_sweep import mean_ci, merged_payload  # noqa: E402
from smollm2_base import MATH500  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2.py"
CONDITIONS = ("gt_reward", "ttrl", "pair_demo", "pair_same")
# curve name -> metrics.jsonl key after "<agent>/" (eos_rate is 1 - completions/clipped_ratio)
CURVES = {"eval_accuracy": "eval_reward", "reward": "reward", "mean_length": "completions/mean_length",
          "eos_rate": "completions/clipped_ratio", "logp_gap_mean": "sampling/sampling_logp_difference/mean",
          "logp_gap_max": "sampling/sampling_logp_difference/max",
          "is_ratio_mean": "sampling/importance_sampling_ratio/mean"}


def child_env() -> dict:
    """Children share one accelerator: no preallocation, memory taken as needed. They import this checkout's
    corl_jax: the repository leads PYTHONPATH (smollm2_base.py, run as a script, has no cwd on its path)."""
    return dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))


def pick_world(measured: dict, worlds: list[str], default: str) -> str:
    """The world (query string) to train on, from base_accuracy.json's per-source accuracies (see the docstring)."""
    scored = [(w, measured[f"arithmetic:test?{w}"]["t1_mean"]) for w in worlds if f"arithmetic:test?{w}" in measured]
    fits = [(w, a) for w, a in scored if 0.15 <= a <= 0.6]
    if fits:
        return min(fits, key=lambda wa: ("word_fraction=0" not in wa[0], abs(wa[1] - 0.35)))[0]
    return max(scored, key=lambda wa: wa[1])[0] if scored else default


def _config():
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics_rows(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_one(condition: str, seed: int, world: str, stop_at: float, args, env) -> dict:
    """One training run in a child process, stopped at time `stop_at`; its accuracies and per-step curves."""
    workdir = Path(args.workdirs) / f"{condition}-s{seed}"
    command = [sys.executable, "-m", "corl_jax.train", f"--config={CONFIG}:{condition}", f"--workdir={workdir}",
               f"--config.seed={seed}", f"--config.data_seed={seed}",
               f"--config.data.train_path=arithmetic:rl?{world}", f"--config.data.eval_path=arithmetic:test?{world}",
               *args.override]
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        _, stderr = proc.communicate(timeout=max(1.0, stop_at - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        stderr = f"stopped at the sweep's time limit\n{stderr[-1000:]}"
    result = dict(condition=condition, seed=seed, seconds=round(time.time() - start, 1), command=" ".join(command[1:]))
    if proc.returncode != 0:
        result["error"] = stderr[-3000:]
    rows = _metrics_rows(workdir)
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text())["agents"] if summary_path.is_file() else {}
    names = list(summary) or sorted({key.split("/")[0] for r in rows for key in r if key.endswith("/reward")})
    if not names:
        return result
    agents = {}
    for name in names:
        curves = {curve: [[r["step"], round(float(r[f"{name}/{key}"]), 5)] for r in rows if f"{name}/{key}" in r]
                  for curve, key in CURVES.items()}
        curves["eos_rate"] = [[step, round(1 - v, 5)] for step, v in curves["eos_rate"]]
        means = {f"mean_{curve}": round(float(np.mean([v for _, v in curves[curve]])), 5) if curves[curve] else None
                 for curve in ("reward", "mean_length", "eos_rate", "logp_gap_mean", "is_ratio_mean")}
        evals = curves["eval_accuracy"]
        s = summary.get(name, {})
        agents[name] = dict(base_accuracy=s.get("initial_accuracy", evals[0][1] if evals else None),
                            final_accuracy=s.get("final_accuracy", evals[-1][1] if len(evals) > 1 else None),
                            final_step=evals[-1][0] if evals else None, **means, curves=curves)
    step_times = [r["time/step"] for r in rows if "time/step" in r]
    peaks = [r["memory/peak_bytes_in_use"] for r in rows if "memory/peak_bytes_in_use" in r]
    return dict(result, agents=agents, steps=max((r["step"] for r in rows), default=0),
                mean_step_seconds=round(float(np.mean(step_times)), 3) if step_times else None,
                peak_memory_gib=round(max(peaks) / 2**30, 2) if peaks else None)


def aggregate(runs: list[dict]) -> dict:
    """Per condition and agent: mean and 95% t-interval over seeds."""
    out = {}
    for condition in dict.fromkeys(r["condition"] for r in runs):
        done = [r for r in runs if r["condition"] == condition and "agents" in r
                and all(a["final_accuracy"] is not None for a in r["agents"].values())]
        if not done:
            continue
        table = {}
        for name in done[0]["agents"]:
            a = [r["agents"][name] for r in done]
            table[name] = dict(base=mean_ci([x["base_accuracy"] for x in a]),
                               final=mean_ci([x["final_accuracy"] for x in a]),
                               gain=mean_ci([x["final_accuracy"] - x["base_accuracy"] for x in a]),
                               **{key: mean_ci([x[key] for x in a]) for key in
                                  ("mean_reward", "mean_mean_length", "mean_eos_rate", "mean_logp_gap_mean")
                                  if all(x[key] is not None for x in a)})
        out[condition] = dict(seeds=[r["seed"] for r in done], agents=table)
    return out


# Candidate worlds, easiest first. Each must hold what a run reads: 240 rl prompts (30 steps x 8) and 200 test
# problems. Single operations (levels 1) up to 60 hold ~630 rl and ~415 test problems, so that world's splits are
# cut to n=300; the others hold the default 2,000 and 500 (levels 2 up to 10: only 421 and 277).
WORLDS = ("levels=1&word_fraction=0.0&max_value=60&n=300", "levels=2&word_fraction=0.0&max_value=20",
          "levels=2&word_fraction=1.0&max_value=20", "levels=2,3&word_fraction=0.0&max_value=60")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="experiments/results/smollm2")
    parser.add_argument("--parts", nargs="*", default=[], help="smollm2.pack_parts files to build the checkpoint from")
    parser.add_argument("--conditions", type=lambda s: s.split(","), default=list(CONDITIONS))
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=540, help="stop every run still going after this many s")
    parser.add_argument("--pick-world", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worlds", nargs="+", default=list(WORLDS), help="candidate arithmetic world queries")
    parser.add_argument("--base-args", default="--num 64 --samples 4 --max-new-tokens 192",
                        help="smollm2_base.py's sample sizes for --pick-world")
    parser.add_argument("--override", action="append", default=[], help="extra --config.* flag for every run")
    parser.add_argument("--workdirs", default="")
    parser.add_argument("--name", default="smollm2_sweep.json")
    parser.add_argument("--merge", nargs="+", default=[],
                        help="sweep JSON files (runs of separate commands) whose runs make <out>/<name>; "
                             "FILE:COND,COND takes only those conditions' runs")
    args = parser.parse_args()
    if args.merge:
        payload = merged_payload(args.merge, aggregate, keys=("world", "base_accuracy", "config"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, args.name).write_text(json.dumps(payload, indent=1) + "\n")
        print(json.dumps(payload["summary"], indent=1))
        return
    unknown = sorted(set(args.conditions) - set(CONDITIONS))
    if unknown:
        parser.error(f"unknown conditions {unknown}; use some of {CONDITIONS}")
    t0 = time.time()
    args.workdirs = args.workdirs or tempfile.mkdtemp(prefix="smollm2_sweep_")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    from corl_jax.data import arithmetic_source
    from corl_jax.models import smollm2

    config = _config()
    payload = dict(command=" ".join(sys.argv), config=str(CONFIG.relative_to(REPO)), runs=[], summary={})
    save = lambda: (out / args.name).write_text(json.dumps(payload, indent=1) + "\n")  # noqa: E731
    directory = smollm2.unpack_parts(args.parts) if args.parts else smollm2.smollm2_hf_dir()
    payload["prepare"] = dict(smollm2_dir=str(directory), smollm2_seconds=round(time.time() - t0, 1))
    partner = None
    if "pair_demo" in args.conditions:
        code = "from corl_jax.registry import resolve_model_paths; print(resolve_model_paths([%r])[0])" % config.PARTNER
        partner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env, cwd=REPO)
    world = arithmetic_source("rl", config.WORLD).partition("?")[2]
    if args.pick_world:
        base_json = out / "base_accuracy.json"
        sources = [f"arithmetic:test?{w}" for w in args.worlds] + [MATH500]
        subprocess.run([sys.executable, str(Path(__file__).parent / "smollm2_base.py"), "--out", str(base_json),
                        "--model", str(directory), *args.base_args.split(), "--sources", *sources],
                       env=env, cwd=REPO, check=True)
        measured = json.loads(base_json.read_text())["sources"]
        world = pick_world(measured, args.worlds, world)
        payload["device"] = json.loads(base_json.read_text())["device"]
        payload["base_accuracy"] = {k: {m: v for m, v in x.items() if m != "example_greedy"} for k, x in measured.items()}
    payload.update(world=world, world_seconds=round(time.time() - t0, 1))
    if "word_fraction=0" not in world and "pair_demo" in args.conditions:
        payload["note"] = f"the world {world} has word problems, which the partner {config.PARTNER} never saw"
    save()
    stop_at = t0 + args.time_limit
    jobs = [(c, s) for s in args.seeds for c in args.conditions]
    dropped = []  # pair_demo jobs whose partner failed to build: listed in not_started

    def record_progress() -> None:
        payload["not_started"] = [f"{c}-s{s}" for c, s in jobs + dropped]
        payload["wall_seconds"] = round(time.time() - t0, 1)
        save()

    with ThreadPoolExecutor(args.parallel) as pool:
        pending = set()
        while jobs or pending:
            if partner is not None and partner.poll() is not None:
                stdout, stderr = partner.communicate()
                payload["prepare"].update(partner_seconds=round(time.time() - t0, 1), partner_exit=partner.returncode)
                if partner.returncode != 0:
                    payload["prepare"]["partner_error"] = stderr[-2000:]
                    dropped += [j for j in jobs if j[0] == "pair_demo"]
                    jobs = [j for j in jobs if j[0] != "pair_demo"]
                partner = None
            ready = [j for j in jobs if j[0] != "pair_demo" or partner is None]
            while ready and len(pending) < args.parallel and time.time() < stop_at - 60:
                job = ready.pop(0)
                jobs.remove(job)
                pending.add(pool.submit(run_one, *job, world, stop_at, args, env))
            if not pending and (partner is None or time.time() >= stop_at - 60):
                break
            if not pending:  # only pair_demo runs are left, waiting for the partner
                time.sleep(2)
                continue
            finished, pending = wait(pending, timeout=2, return_when=FIRST_COMPLETED)
            for future in finished:
                run = future.result()
                payload["runs"].append(run)
                payload["summary"] = aggregate(payload["runs"])
                record_progress()
                print(f"{run['condition']} seed {run['seed']}: "
                      + ", ".join(f"{n} {a['base_accuracy']}->{a['final_accuracy']}" for n, a in run.get("agents", {}).items())
                      + (f" ({run['error'][-300:]})" if "error" in run else ""), flush=True)
    if partner is not None:
        partner.kill()
    record_progress()
    print(json.dumps(payload["summary"], indent=1))


if __name__ == "__main__":
    main()
