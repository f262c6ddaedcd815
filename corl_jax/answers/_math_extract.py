"""Answer extraction of the Qwen2.5-Math evaluation parser: `extract_answer(text, "math")` and `strip_string`.

Reference semantics rule by rule, quirks included (co_rl_reference.md §1.4, §7.1): e.g. the MathQA unit
list deletes isolated single letters (`x + a` -> `x+`), and with no other cue the last number anywhere in
the text is the answer.
"""

from __future__ import annotations

import functools
import re

from word2number import w2n

from corl_jax.answers._math_normalize import fix_a_slash_b, fix_fracs, lead_zero_and_drop_short_lhs

# Unit strings (mostly MathQA) in the reference's order; duplicates are kept because the substitutions run
# in sequence. They are used as regex *patterns*, like in the reference: the "." in "q ." matches any
# character.
_UNIT_WORDS = (
    "east", "degree", "mph", "kmph", "ft", "m sqaure", " m east", "sq m", "deg", "mile", "q .",
    "monkey", "prime", "ratio", "profit of rs", "rd", "o", "gm", "p . m", "lb", "tile", "per", "dm",
    "lt", "gain", "ab", "way", "west", "a .", "b .", "c .", "d .", "e .", "f .", "g .", "h .", "t",
    "a", "h", "no change", "men", "soldier", "pie", "bc", "excess", "st", "inches", "noon",
    "percent", "by", "gal", "kmh", "c", "acre", "rise", "a . m", "th", "π r 2", "sq", "mark", "l",
    "toy", "coin", "sq . m", "gallon", "° f", "profit", "minw", "yr", "women", "feet", "am", "pm",
    "hr", "cu cm", "square", "v â € ™", "are", "rupee", "rounds", "cubic", "cc", "mtr", "s", "ohm",
    "number", "kmph", "day", "hour", "minute", "min", "second", "man", "woman", "sec", "cube", "mt",
    "sq inch", "mp", "∏ cm ³", "hectare", "more", "sec", "unit", "cu . m", "cm 2", "rs .", "rs",
    "kg", "g", "month", "km", "m", "cm", "mm", "apple", "liter", "loss", "yard", "pure", "year",
    "increase", "decrease", "d", "less", "Surface", "litre", "pi sq m", "s .", "metre", "meter",
    "inch",
)
UNIT_TEXTS = _UNIT_WORDS + tuple(word + "s" for word in _UNIT_WORDS)

_WORD_RUN = re.compile(r"\w+")


def _unit_filter(unit: str) -> tuple[str | None, str | None]:
    r"""Two cheap necessary conditions for `(^|\W)unit($|\W)` to match a string: (word, literal).

    word: the unit's leading `\w+` run, which a match turns into a whole `\w+` run of the string (a non-word
    character or the start precedes it, and a literal non-word character or the end follows it), so it must be
    among the string's word runs; None when the unit does not start with a word character or a `.` (which
    matches anything) follows the run. literal: the unit itself when it has no regex metacharacter (only `.`
    occurs in the list), which must then occur in the string.
    """
    lead = _WORD_RUN.match(unit)
    word = lead.group() if lead is not None and unit[lead.end() : lead.end() + 1] != "." else None
    return word, None if "." in unit else unit


_UNIT_PATTERNS = tuple(
    (re.compile(r"(^|\W)" + unit + r"($|\W)"), *_unit_filter(unit)) for unit in UNIT_TEXTS
)

_ARRAY_BEGIN = re.compile(r"\\begin\{array\}\{.*?\}")
_ARRAY_END = re.compile(r"\\end\{array\}")
_TRAILING_TEXT = re.compile(r"\\text{.*?}$")
_TEXT = re.compile(r"\\text\{(.*?)\}")
_MBOX = re.compile(r"\\mbox{.*?}")
# The reference's `(\d+)\.0*([^\d])` and `(\d+)\.0*$`. A match can only start where a digit run starts (a
# match starting inside a run would extend to its start), so the `(?<!\d)` changes no result but makes
# long digit runs linear instead of quadratic.
_ZEROS_BEFORE_NON_DIGIT = re.compile(r"(?<!\d)(\d+)\.0*([^\d])")
_ZEROS_AT_END = re.compile(r"(?<!\d)(\d+)\.0*$")
_SQRT_WORD = re.compile(r"\\sqrt(\w+)")
_NUMBER = re.compile(r"-?\d*\.?\d+")
_DIGIT = re.compile(r"\d")
_NUMBER_CHARS = re.compile(r"[\d.\-]*")
_NEWLINE_AND_INDENT = re.compile(r"\n\s*")
_VARIABLE_PREFIXES = ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to")


def _words_to_number(s: str) -> str:
    """`two` -> `2`, `point five` -> `0.5` (word2number, as the reference); unchanged when it fails."""
    try:
        return str(w2n.word_to_num(s))
    except Exception:  # the reference swallows every failure of word2number
        return s


def _remove_units(s: str) -> str:
    """The reference's two passes of unit substitutions, skipping those that provably cannot match."""
    for _ in range(2):
        words = set(_WORD_RUN.findall(s))
        for pattern, word, literal in _UNIT_PATTERNS:
            if (word is not None and word not in words) or (literal is not None and literal not in s):
                continue
            without = pattern.sub(r"\1\2", s)
            if without != "" and without != s:
                s = without
                words = set(_WORD_RUN.findall(s))
    return s


def strip_string(string: object, skip_unit: bool = False) -> str:
    r"""Qwen2.5-Math `strip_string`: canonicalise an extracted answer (units, `\text`, `\left`, fractions...).

    The reference's bracket unwrapping (`{..}`/`(..)`/`[..]` when the whole string `isalnum()`) can never
    fire and its quote removal discards its result; both are omitted.
    """
    return _strip_string(str(string).strip(), bool(skip_unit))


# Answers repeat within a step (a prompt's rollouts agree) and across steps; entries are answer-sized.
@functools.lru_cache(maxsize=1 << 13)
def _strip_string(s: str, skip_unit: bool) -> str:
    s = s.replace("\n", "").rstrip(".").replace("\\!", "")
    s = _ARRAY_BEGIN.sub(r"\\begin{pmatrix}", s)
    s = _ARRAY_END.sub(r"\\end{pmatrix}", s)
    s = s.replace("bmatrix", "pmatrix")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\{", "{").replace("\\}", "}")
    without_text = _TRAILING_TEXT.sub("", s).strip()
    if without_text != "" and without_text != s:
        s = without_text
    if not skip_unit:
        s = _remove_units(s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "")
    s = _words_to_number(s)
    s = _TEXT.sub(r"\1", s)
    for prefix in _VARIABLE_PREFIXES:
        s = s.replace(prefix, "")
    s = s.replace("\\emptyset", "{}")
    s = s.replace("(-\\infty,\\infty)", "\\mathbb{R}")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = s.replace("+\\inity", "\\infty")
    s = s.replace("and", "").replace("\\mathbf", "")
    s = _MBOX.sub("", s)
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    s = _ZEROS_BEFORE_NON_DIGIT.sub(r"\1\2", s)
    s = _ZEROS_AT_END.sub(r"\1", s)
    if not s:
        return s
    s = lead_zero_and_drop_short_lhs(s)
    s = _SQRT_WORD.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = fix_fracs(s, empty_piece_raises=False)
    return fix_a_slash_b(s, sqrt_operands=True)


def _boxed_content(after_boxed: str) -> str:
    """Brace-balanced `{...}` after the last `boxed` (unclosed: all the rest), else the text up to a `$`."""
    if not after_boxed:
        return ""
    if after_boxed[0] != "{":
        return after_boxed.split("$")[0].strip()
    depth = 1
    for end, char in enumerate(after_boxed[1:], start=1):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return after_boxed[1:end]
    return after_boxed[1:]


def _last_number(text: str) -> str:
    """`_NUMBER.findall(text)[-1]` ("" if none) without scanning the whole text.

    A match holds only digits, `.` and `-` and ends with a digit, so the last match ends at the text's last
    digit and lies in the run of those characters around it; a character outside them stops every match,
    so scanning that run alone finds the same matches in it as scanning the whole text.
    """
    backwards = text[::-1]
    last_digit = _DIGIT.search(backwards)
    if last_digit is None:
        return ""
    run_start = len(text) - _NUMBER_CHARS.match(backwards, last_digit.start()).end()
    return _NUMBER.findall(text, run_start, len(text) - last_digit.start())[-1]


def _select_answer(text: str) -> str:
    if "final answer is $" in text and "$. I hope" in text:  # Minerva format
        return text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    if "boxed" in text:
        return _boxed_content(text.split("boxed")[-1])
    if "he answer is" in text:
        return text.split("he answer is")[-1].strip()
    if "final answer is" in text:
        return text.split("final answer is")[-1].strip()
    if "答案是" in text:
        return text.split("答案是")[1].strip().split("\n\n")[0].strip()
    return _last_number(text.replace(",", ""))


def extract_answer(text: str) -> str:
    r"""Qwen2.5-Math `extract_answer(text, "math")`: the answer of a completion, canonicalised; "" if none.

    Priority: Minerva "final answer is $...$. I hope", the last `\boxed`, "he answer is", "final answer
    is", "答案是", then the last number in the text.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects the completion text as str, got {type(text).__name__}")
    answer = _select_answer(text.replace("\u043a\u0438", ""))
    answer = _NEWLINE_AND_INDENT.sub("", answer)
    if answer[:1] == ":":
        answer = answer[1:]
    if answer[-1:] == ".":
        answer = answer[:-1]
    if answer[-1:] == "/":
        answer = answer[:-1]
    return strip_string(answer)
