"""Math answers with the reference's semantics: extraction, vote keys and grading (co_rl_reference.md §7).

* `extract_answer(text)`: the Qwen2.5-Math parser (`extract_answer(text, "math")`), "" when nothing is found.
* `normalize_answer(s)`: the Hendrycks MATH normaliser; `vote_key(text)` = extract then normalise (None
  when there is no answer). Votes cluster on exact equality of these keys.
* `grade_answer_raw(pred, gold)`: the prm800k grader (TTRL, GT-Reward and intrinsic baselines).
* `grade_answer(pred, gold)`: the Co-RL reward's grader = the raw grader, then a retry with LaTeX
  scientific notation rewritten (`3.74\\times10^{24}` -> `3.74e24`) in the prediction, then in the gold.
* `grade_answers(pairs)` / `grade_answers_raw(pairs)`: the same for many pairs at once (a step's distinct
  (pred, label) pairs), their sympy checks run together on `SYMPY_WORKERS` parallel worker processes.

Quirks of the reference are reproduced on purpose (unit-word deletion of single letters, string-level vote
buckets, no numeric tolerance except integer snapping at 1e-7, unreduced fractions rejected, tuple order
matters). Model output is untrusted: the symbolic check runs only on whitelisted text, in a separate
process bounded by `SYMPY_TIMEOUT_S` (a timeout grades False); results are cached per (pred, gold) pair,
per normalised answer and per sympy expression.
Deliberate differences from the reference (none on the spec's cases or on MATH-500): an element pair whose
symbolic check would need `_` (so also subscripts like `a_1`), quotes, brackets, `=`, a keyword or builtin
name, or a `**` power chain is graded False without evaluation; grading against `UNLABELED` is always
False; a scientific-notation exponent too long for `int` is left as text instead of raising.
"""

from __future__ import annotations

import collections
import functools
import re
import threading
from typing import Iterable

from corl_jax.answers import _math_extract, _math_grade, _math_normalize, _sympy_worker
from corl_jax.answers._math_extract import extract_answer, strip_string
from corl_jax.answers._math_grade import is_safe_sympy_input, split_tuple
from corl_jax.answers._math_normalize import normalize_answer

__all__ = [
    "SYMPY_TIMEOUT_S",
    "UNLABELED",
    "clear_caches",
    "extract_answer",
    "SYMPY_WORKERS",
    "grade_answer",
    "grade_answer_raw",
    "grade_answers",
    "grade_answers_raw",
    "is_safe_sympy_input",
    "normalize_answer",
    "normalize_sci_notation",
    "split_tuple",
    "strip_string",
    "vote_key",
]

#: Wall-clock limit (seconds) of one sympy check; past it the worker is killed and the pair grades False.
#: Read at call time, so it can be changed at any moment (cached results are kept: see `clear_caches`).
SYMPY_TIMEOUT_S = 5.0

#: Worker processes that run the sympy checks of a `grade_answers` batch in parallel. Read at call time.
SYMPY_WORKERS = 2

#: Label of a prompt whose teacher produced no vote (co_label_utils._UNLABELED_SENTINEL).
UNLABELED = "\x00__unlabeled__\x00"

_CACHE_SIZE = 1 << 16
# co_label_utils' pattern with `(?<!\d)` added before the mantissa's digits: leftmost matches never start
# inside a digit run, so results are unchanged, but long digit runs cost linear instead of quadratic time.
_LATEX_SCI = re.compile(
    r"(-?\s*(?<!\d)\d+(?:\.\d+)?)\s*(?:\\times|\\cdot|\*)\s*10\s*\^\s*\{?\s*(-?\d+)\s*\}?"
)


def vote_key(text: str) -> str | None:
    """The majority-vote key of a completion: `normalize_answer(extract_answer(text))`, None if empty."""
    return normalize_answer(extract_answer(text)) or None


def _sci_replacement(match: re.Match) -> str:
    mantissa, exponent = match.group(1), match.group(2)
    try:
        exponent = str(int(exponent))
    except ValueError:  # over Python's int-string digit limit (the reference would raise): keep the text
        return match.group(0)
    return f"{mantissa.replace(' ', '')}e{exponent}"


def normalize_sci_notation(s: str | None) -> str | None:
    r"""`3.74 \times 10^{24}` -> `3.74e24`, `- 2 \times 10^{3}` -> `-2e3` (co_label_utils); non-str as is."""
    if not isinstance(s, str) or "^" not in s:  # every match contains `^`
        return s
    return _LATEX_SCI.sub(_sci_replacement, s)


class _SympyPending(Exception):
    """Inside `_grade_batch`: a grade needs a sympy check whose result is not known yet."""

    def __init__(self, expr: str) -> None:
        super().__init__(expr)
        self.expr = expr


_batch = threading.local()  # .active: grades raise _SympyPending instead of calling the worker
_zero_cache: collections.OrderedDict[str, bool] = collections.OrderedDict()  # expr -> is zero (LRU)
_zero_cache_lock = threading.Lock()


def _checked_timeout() -> float:
    timeout_s = SYMPY_TIMEOUT_S
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(
            "corl_jax.answers.math.SYMPY_TIMEOUT_S must be a positive, finite number of seconds, "
            f"got {timeout_s!r}"
        )
    return timeout_s


def _remember_zero(expr: str, is_zero: bool) -> None:
    with _zero_cache_lock:
        _zero_cache[expr] = is_zero
        if len(_zero_cache) > _CACHE_SIZE:
            _zero_cache.popitem(last=False)


def _evaluate_with_sympy(exprs: list[str]) -> list[bool]:
    """Run the sympy checks of `exprs` (in parallel) and cache their results."""
    results = _sympy_worker.are_zero(exprs, _checked_timeout(), SYMPY_WORKERS)
    for expr, is_zero in zip(exprs, results):
        _remember_zero(expr, is_zero)
    return results


def _sympy_is_zero(expr: str) -> bool:
    with _zero_cache_lock:
        known = _zero_cache.get(expr)
        if known is not None:
            _zero_cache.move_to_end(expr)
            return known
    known = _sympy_worker.integer_difference_is_zero(expr)
    if known is not None:
        return known
    if getattr(_batch, "active", False):
        raise _SympyPending(expr)
    return _evaluate_with_sympy([expr])[0]


def _check_answer_types(pred: object, gold: object) -> None:
    for name, value in (("pred", pred), ("gold", gold)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"grade_answer: {name} must be str or None, got {type(value).__name__}")


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _grade_raw(pred: str | None, gold: str | None) -> bool:
    if gold == UNLABELED:
        return False
    return _math_grade.grade(pred, gold, _sympy_is_zero)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _grade_co_rl(pred: str | None, gold: str | None) -> bool:
    if _grade_raw(pred, gold):
        return True
    sci_pred = normalize_sci_notation(pred)
    if sci_pred != pred and _grade_raw(sci_pred, gold):
        return True
    sci_gold = normalize_sci_notation(gold)
    return sci_gold != gold and _grade_raw(pred, sci_gold)


def grade_answer_raw(pred: str | None, gold: str | None) -> bool:
    """prm800k `grade_answer(pred, gold)`: normalised string equality, else per-element sympy equality."""
    _check_answer_types(pred, gold)
    return _grade_raw(pred, gold)


def grade_answer(pred: str | None, gold: str | None) -> bool:
    """The Co-RL reward's equivalence: raw grader, then the scientific-notation retries (pred, then gold)."""
    _check_answer_types(pred, gold)
    return _grade_co_rl(pred, gold)


def _grade_batch(grade, pairs: Iterable[tuple[str | None, str | None]]) -> list[bool]:
    """`[grade(pred, gold) for pred, gold in pairs]`, with the sympy checks of all pairs run together.

    Rounds: every undecided pair is graded; one that reaches a sympy check with no known result stops
    there (`_SympyPending`), and the checks collected in the round run in parallel before the next round.
    So each pair makes exactly the sympy checks, in the order, of its one-by-one grading.
    """
    pairs = list(pairs)
    for pred, gold in pairs:
        _check_answer_types(pred, gold)
    results: dict[tuple[str | None, str | None], bool] = {}
    undecided = list(dict.fromkeys(pairs))
    _batch.active = True
    try:
        while undecided:
            needed: dict[str, None] = {}
            waiting = []
            for pair in undecided:
                try:
                    results[pair] = grade(*pair)
                except _SympyPending as pending:
                    needed[pending.expr] = None
                    waiting.append(pair)
            if needed:
                _evaluate_with_sympy(list(needed))
            undecided = waiting
    finally:
        _batch.active = False
    return [results[pair] for pair in pairs]


def grade_answers(pairs: Iterable[tuple[str | None, str | None]]) -> list[bool]:
    """`[grade_answer(pred, gold) for pred, gold in pairs]` (same results), sympy checks in parallel."""
    return _grade_batch(_grade_co_rl, pairs)


def grade_answers_raw(pairs: Iterable[tuple[str | None, str | None]]) -> list[bool]:
    """`[grade_answer_raw(pred, gold) for pred, gold in pairs]` (same results), sympy checks in parallel."""
    return _grade_batch(_grade_raw, pairs)


def clear_caches() -> None:
    """Forget every cached result: grades, sympy checks, stripped and normalised answers (e.g. after
    changing `SYMPY_TIMEOUT_S`, or to time a cold start)."""
    _grade_raw.cache_clear()
    _grade_co_rl.cache_clear()
    with _zero_cache_lock:
        _zero_cache.clear()
    _math_extract._strip_string.cache_clear()
    _math_normalize._normalize.cache_clear()
    _math_grade._grader_normalize.cache_clear()
