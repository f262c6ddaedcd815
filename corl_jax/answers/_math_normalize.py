"""Hendrycks MATH answer normaliser (`math_normalize.normalize_answer` of prm800k), reference semantics.

It turns an answer string into the key that majority votes cluster on (co_rl_reference.md §7.2). The two
LaTeX repairs `fix_fracs` and `fix_a_slash_b` are shared with the Qwen2.5-Math parser, which uses
slightly different variants of them (selected by keyword).
"""

from __future__ import annotations

import functools
import re

# `\text{...}` spanning the whole answer (`$` also matches before a final newline, as in the reference).
_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class _Malformed(ValueError):
    """The reference raises here (IndexError/AssertionError); `normalize_answer` then returns its input."""


def fix_fracs(s: str, *, empty_piece_raises: bool) -> str:
    r"""Brace the arguments of `\frac12`/`\frac1{72}` -> `\frac{1}{2}`/`\frac{1}{72}`.

    A `\frac` followed by fewer than two characters leaves the whole string unchanged; a `\frac` at the
    very end raises `_Malformed` in the Hendrycks variant (`empty_piece_raises=True`), as the reference's
    `substr[0]` does.
    """
    pieces = s.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece.startswith("{"):
            out += piece
            continue
        if not piece and empty_piece_raises:
            raise _Malformed("trailing \\frac")
        if len(piece) < 2:
            return s
        numerator, second, rest = piece[0], piece[1], piece[2:]
        if second == "{":
            out += "{" + numerator + "}" + second + rest
        else:
            out += "{" + numerator + "}{" + second + "}" + rest
    return out


def fix_a_slash_b(s: str, *, sqrt_operands: bool = False) -> str:
    r"""`a/b` with integer `a`, `b` (written exactly as Python prints them) -> `\frac{a}{b}`.

    `sqrt_operands=True` (Qwen2.5-Math variant) also accepts an operand containing `sqrt` verbatim.
    """
    parts = s.split("/")
    if len(parts) != 2:
        return s
    operands = []
    for part in parts:
        if sqrt_operands and "sqrt" in part:
            operands.append(part)
            continue
        try:
            operands.append(str(int(part)))
        except ValueError:
            return s
    if s != f"{operands[0]}/{operands[1]}":
        return s
    return "\\frac{" + operands[0] + "}{" + operands[1] + "}"


def lead_zero_and_drop_short_lhs(s: str) -> str:
    """Rules both reference normalisers share, on a non-empty string: ".5" -> "0.5"; "k = 7" -> " 7" (an equation
    whose left side has at most 2 characters gives its right side)."""
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    return s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    pieces = s.split("\\text{ ")
    if len(pieces) != 2:
        raise _Malformed("more than one '\\text{ ' unit")
    return pieces[0]


def _fix_sqrt(s: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}` (first character only); a trailing `\sqrt` raises like the reference."""
    if "\\sqrt" not in s:
        return s
    pieces = s.split("\\sqrt")
    out = pieces[0]
    for piece in pieces[1:]:
        if not piece:
            raise _Malformed("trailing \\sqrt")
        if piece[0] != "{":
            out += "\\sqrt{" + piece[0] + "}" + piece[1:]
        else:
            out += "\\sqrt" + piece
    return out


def _strip_string(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    s = lead_zero_and_drop_short_lhs(s)
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = fix_fracs(s, empty_piece_raises=True)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return fix_a_slash_b(s)


def normalize_answer(answer: str | None) -> str | None:
    r"""Hendrycks/prm800k normal form of an answer (`\dfrac12` -> `\frac{1}{2}`, `0.5` -> `\frac{1}{2}`, ...).

    None stays None. When the reference would raise (two `\text{ ` units, a trailing `\frac` or
    `\sqrt`), the stripped input (with a whole-string `\text{...}` unwrapped) is returned unchanged.
    """
    if answer is None:
        return None
    if not isinstance(answer, str):
        raise TypeError(f"normalize_answer expects str or None, got {type(answer).__name__}")
    return _normalize(answer.strip())


# The grader normalises both sides of every (pred, label) pair it sees; answers repeat across pairs.
@functools.lru_cache(maxsize=1 << 13)
def _normalize(answer: str) -> str:
    try:
        whole_text = _WHOLE_TEXT.search(answer)
        if whole_text is not None:
            answer = whole_text.group("text").strip()
        return _strip_string(answer)
    except _Malformed:
        return answer
