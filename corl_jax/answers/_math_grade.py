"""The prm800k answer grader (`math_grade.grade_answer`), reference semantics (co_rl_reference.md §7.3).

String normalisation, tuple splitting and the fraction/integer rules run here, in-process; the final
symbolic check (`simplify((gt) - (given)) == 0`) is delegated to a callable so that it can run in a
time-limited worker process. Expressions reach that callable only if they pass the reference's guard
*and* `is_safe_sympy_input`, a whitelist that keeps model output away from Python evaluation.
"""

from __future__ import annotations

import builtins
import functools
import keyword
import re
from typing import Callable

from pylatexenc import latex2text, macrospec

from corl_jax.answers._math_normalize import normalize_answer

_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_UNIT_RES = tuple(
    re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?")
    for unit in (
        "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
        "month", "year", "foot", "feet", "inch", "yard",
    )
)
_CIRC = re.compile(r"\^ *\\circ")
_THIN_SPACE_AFTER_COMMA = re.compile(r",\\! *")
_DASH_SPACES = re.compile(r"- *")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TUPLE_CHARS = "()[]"
_LATEX_TO_TEXT_CHARS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))

# The reference's guard against expressions sympy may hang on.
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))

# Our stricter whitelist (see `is_safe_sympy_input`).
_PLAIN_CHARS = frozenset("0123456789+-*/^().,! ")
_ATTRIBUTE_ACCESS = re.compile(r"\.\s*[^\W\d]")
_IDENTIFIER = re.compile(r"[^\W\d_]\w*")
_BUILTIN_NAMES = frozenset(vars(builtins))


def _latex_context() -> macrospec.LatexContextDb:
    """pylatexenc's default context, `\\ensuremath{..}` dropped as by 2.10 (the reference's)."""
    context = latex2text.get_default_latex_context_db()
    context.add_context_category(
        "pylatexenc-2.10", prepend=True, macros=[latex2text.MacroTextSpec("ensuremath", discard=True)]
    )
    return context


_LATEX_CONTEXT = _latex_context()


def _latex_to_text(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # keeps mixed numbers apart: 7\frac34 -> 7 3/4
    # A fresh converter per call, as the reference: \title etc. store state on the converter.
    expr = latex2text.LatexNodes2Text(latex_context=_LATEX_CONTEXT).latex_to_text(expr)
    for symbol, word in _LATEX_TO_TEXT_CHARS:
        expr = expr.replace(symbol, word)
    return expr.strip()


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _strip_thousands_commas(expr: str) -> str:
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return expr
        expr = stripped


def str_is_int(s: str) -> bool:
    """True when `s` (well-formed thousands commas allowed) is a float within 1e-7 of an integer."""
    try:
        return _is_int(float(_strip_thousands_commas(s)))
    except ValueError:
        return False


def is_frac(s: str) -> bool:
    """The reference's plain-fraction pattern `^-?[0-9]+.?/0*[1-9][0-9]*.?$`."""
    return _FRACTION.search(s) is not None


def grader_normalize(expr: str | None) -> str | None:
    """The grader's `_normalize`: units, `$`, `%`, LaTeX to text, spaces, braces, case, integers."""
    if expr is None:
        return None
    return _grader_normalize(expr)


# pylatexenc makes this the grader's slowest in-process part; each pair normalises both of its answers.
@functools.lru_cache(maxsize=1 << 13)
def _grader_normalize(expr: str) -> str:
    whole_text = _WHOLE_TEXT.search(expr)
    if whole_text is not None:
        expr = whole_text.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_RES:
        expr = unit.sub("", expr)
    expr = _CIRC.sub("", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = _THIN_SPACE_AFTER_COMMA.sub("", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _latex_to_text(expr)
        except Exception:  # the reference ignores every pylatexenc failure (incl. RecursionError)
            pass
    expr = _DASH_SPACES.sub("-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))  # truncates, as the reference
    return expr


def split_tuple(expr: str) -> list[str]:
    """Elements of a bracketed tuple/interval `(a,b)`/`[a,b)` without inner brackets; else `[expr]`."""
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and not any(char in expr[1:-1] for char in _TUPLE_CHARS)
    ):
        return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def reference_allows_sympy(expr: str) -> bool:
    """The reference's `should_allow_eval`: ≤2 distinct letters (besides sqrt, frac), no `^{`, `^(`,
    chained `^` or multi-digit exponents."""
    letters = {char for char in expr.replace("sqrt", "").replace("frac", "") if char.isalpha()}
    if len(letters) > 2:
        return False
    if any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return not any(bad.search(expr) for bad in _BAD_POWERS)


def is_safe_sympy_input(expr: str) -> bool:
    """Our whitelist on top of the reference's guard, for text that `parse_expr` (Python eval) will see.

    Allowed: digits, ASCII and Greek letters, spaces and `+ - * / ^ ( ) . , !`. Rejected besides: attribute
    access (a dot before a letter), Python keywords and builtin names as identifiers, and the reference's
    power rules applied to `**` as well as `^` (so `9**9**9` is refused like `9^9^9`). Underscores,
    quotes, brackets, `=`, `:`, `;`, `@`, `%`, `|`, `&`, `~`, `<`, `>` and backslashes never pass.
    """
    for char in expr:
        if char in _PLAIN_CHARS or (char.isalpha() and (char.isascii() or "\u0370" <= char <= "\u03ff")):
            continue
        return False
    if _ATTRIBUTE_ACCESS.search(expr):
        return False
    for name in _IDENTIFIER.findall(expr):
        if keyword.iskeyword(name) or name in _BUILTIN_NAMES:
            return False
    powers = expr.replace("**", "^")
    if any(bad in powers for bad in _BAD_SUBSTRINGS):
        return False
    return not any(bad.search(powers) for bad in _BAD_POWERS)


def _equal_elements(gt: str, given: str, sympy_is_zero: Callable[[str], bool]) -> bool:
    if is_frac(gt) and is_frac(given):
        return gt == given  # unreduced fractions must not be rescued by sympy
    if str_is_int(gt) != str_is_int(given):
        return False
    difference = f"({gt})-({given})"
    if not (reference_allows_sympy(difference) and is_safe_sympy_input(difference)):
        return False
    return sympy_is_zero(difference)


def grade(given: str | None, ground_truth: str | None, sympy_is_zero: Callable[[str], bool]) -> bool:
    """prm800k `grade_answer(given, ground_truth)`; `sympy_is_zero(expr)` decides `simplify(expr) == 0`."""
    if given is None:
        return False
    if normalize_answer(ground_truth) == normalize_answer(given):
        return True
    gt_normalized = grader_normalize(ground_truth)
    given_normalized = grader_normalize(given)
    if gt_normalized is None:
        return False
    if gt_normalized == given_normalized:
        return True
    if not given_normalized:
        return False
    gt_elements = split_tuple(gt_normalized)
    given_elements = split_tuple(given_normalized)
    if len(gt_elements) > 1 and (
        gt_normalized[0] != given_normalized[0] or gt_normalized[-1] != given_normalized[-1]
    ):
        return False
    if len(gt_elements) != len(given_elements):
        return False
    return all(
        _equal_elements(gt, given, sympy_is_zero) for gt, given in zip(gt_elements, given_elements)
    )
