"""What a task (`config.task`) adds to a step: the vote key of a completion, the reward's equivalence and the
in-loop eval grading. The vote, teacher and reward kernel (`voting.score_step`) is the same for every task.

* math (co_rl_reference.md §1.4, §1.9): key = the normalized extracted answer; reward = the sympy-backed grader of
  the raw extraction against the teacher's key (Co-RL: the sci-notation wrapper, baselines: the raw grader); eval =
  the same grader against the gold answer.
* code (§3.4, §1.9 "coding"): key = `repr` of the tuple of outputs of the completion's code on the problem's test
  inputs, run in the sandbox (`answers.code`), None (unlabeled) when there is no code, no test input, or every call
  failed; reward = string equality with the teacher's key; eval = pass@1 of the problem's tests.
"""

from __future__ import annotations

import concurrent.futures
import operator
import os
import time
from typing import Sequence

import ml_collections

from corl_jax import voting
from corl_jax.answers import code as code_answers
from corl_jax.answers import math as math_answers
from corl_jax.data import Problem


class MathTask:
    """Boxed/last-number answers graded by the reference's math verifier."""

    def __init__(self, method: str):
        co_rl = method == "co_rl"  # Co-RL: sci-notation wrapper; baselines: raw grader (§11.6)
        self.grader = voting.PairGrader(
            math_answers.grade_answer if co_rl else math_answers.grade_answer_raw,
            grade_many=math_answers.grade_answers if co_rl else math_answers.grade_answers_raw)

    def score(self, texts_by_agent: Sequence[Sequence[str]], problems: Sequence[Problem], *, topology: str,
              threshold: float, step: int, agent_names: Sequence[str]) -> voting.StepResult:
        return voting.score_step(
            texts_by_agent, [p.answer for p in problems], topology=topology, threshold=threshold,
            grader=self.grader, extract=math_answers.extract_answer, normalize=math_answers.normalize_answer,
            step=step, prompt_ids=[p.id for p in problems], agent_names=agent_names)

    def eval_correct(self, texts: Sequence[str], problems: Sequence[Problem]) -> list[bool]:
        """Per completion, whether it answers its problem (`problems` aligned with `texts`)."""
        return [self.grader(math_answers.extract_answer(t), p.answer) for t, p in zip(texts, problems)]


def _key_or_none(key: str) -> str | None:
    return key or None


class CodeTask:
    """Python functions voted by their outputs on the problem's test inputs (the reference's CoMAS path).

    A problem's answer is its test code: CoMAS style (`assert f(args) == expected` and `test*` functions; inputs by
    `answers.code.extract_calls`, as the reference) or, when the problem has an `entry_point`, HumanEval style (a
    `check(candidate)` function; inputs from its `candidate(...)` calls, called as the entry point, and pass@1 runs
    `check(<entry point>)`). Identical code for the same problem runs once per call; sandboxes run
    `sandbox_workers` at a time.
    """

    def __init__(self, settings: ml_collections.ConfigDict):
        self.vote_limits = code_answers.SandboxLimits(call_seconds=settings.call_seconds)
        self.test_limits = code_answers.SandboxLimits(call_seconds=settings.test_seconds)
        self.workers = settings.sandbox_workers or os.cpu_count() or 1
        self.grader = voting.PairGrader(operator.eq)  # §1.9: reward = exact string equality with the label
        self._calls: dict[tuple[str, int], tuple[str | None, list[tuple]]] = {}
        self._reference_keys: dict[tuple[str, int], str | None] = {}

    def calls(self, problem: Problem) -> tuple[str | None, list[tuple]]:
        """(function name, argument tuples) the vote key calls, parsed once per problem."""
        key = (problem.source, problem.id)
        if key not in self._calls:
            if problem.entry_point:
                self._calls[key] = problem.entry_point, code_answers.candidate_calls(problem.answer)
            else:
                self._calls[key] = code_answers.extract_calls(problem.answer)
        return self._calls[key]

    def test_code(self, problem: Problem) -> str:
        if problem.entry_point:
            return f"{problem.answer}\n\ndef test_check():\n    check({problem.entry_point})\n"
        return problem.answer

    def vote_keys(self, texts: Sequence[str], problems: Sequence[Problem]) -> list[str | None]:
        """The vote key of each completion (`problems` aligned with `texts`)."""
        jobs = {}  # (code, problem) -> future: identical code for the same problem runs once
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            for text, problem in zip(texts, problems):
                job = (code_answers.extract_code(text), problem.source, problem.id)
                if job not in jobs:
                    jobs[job] = pool.submit(code_answers.output_key, text, *self.calls(problem),
                                            limits=self.vote_limits)
            return [jobs[code_answers.extract_code(t), p.source, p.id].result() for t, p in zip(texts, problems)]

    def reference_key(self, problem: Problem) -> str | None:
        """The key of the problem's canonical solution (None without one): the oracle of the co-labeling metrics."""
        key = (problem.source, problem.id)
        if key not in self._reference_keys:
            self._reference_keys[key] = None if problem.canonical_solution is None else code_answers.output_key(
                problem.canonical_solution, *self.calls(problem), limits=self.vote_limits)
        return self._reference_keys[key]

    def score(self, texts_by_agent: Sequence[Sequence[str]], problems: Sequence[Problem], *, topology: str,
              threshold: float, step: int, agent_names: Sequence[str]) -> voting.StepResult:
        t0 = time.perf_counter()
        g = len(texts_by_agent[0]) // len(problems)
        per_completion = [p for p in problems for _ in range(g)]
        keys = [[k or "" for k in self.vote_keys(texts, per_completion)] for texts in texts_by_agent]
        oracle = [self.reference_key(p) for p in problems]
        sandbox = time.perf_counter() - t0
        # The keys are the answers: identity extraction, "" (no key) -> None, equality as the grade.
        result = voting.score_step(keys, oracle, topology=topology, threshold=threshold, grader=self.grader,
                                   extract=str, normalize=_key_or_none, step=step,
                                   prompt_ids=[p.id for p in problems], agent_names=agent_names)
        result.timings["time/answers"] += sandbox
        return result

    def eval_correct(self, texts: Sequence[str], problems: Sequence[Problem]) -> list[bool]:
        """pass@1: each completion against its problem's tests."""
        return code_answers.passes_tests_batch(texts, [self.test_code(p) for p in problems],
                                               limits=self.test_limits, max_workers=self.workers)


def make_task(config: ml_collections.ConfigDict) -> MathTask | CodeTask:
    return CodeTask(config.code) if config.task == "code" else MathTask(config.method)
