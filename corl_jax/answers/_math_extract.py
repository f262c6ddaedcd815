"""Answer extraction of the Qwen2.5-Math evaluation parser: `extract_answer(text, "math")` and `strip_string`.

Reference semantics rule by rule, quirks included (co_rl_reference.md §1.4, §7.1): e.g. the MathQA unit
list deletes isolated single letters (`x + a` -> `x+`), and with no other cue the last number anywhere in
the text is the answer.
"""

from __future__ import annotations

import re

from word2number import w2n

from corl_jax.answers._math_normalize import fix_a_slash_b, fix_fracs

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

# (pattern, literal): when the unit has no regex metacharacter, the pattern can only match if the literal
# occurs in the string, which lets most of the ~300 substitutions be skipped without changing results.
_UNIT_PATTERNS = tuple(
    (re.compile(r"(^|\W)" + unit + r"($|\W)"), None if "." in unit else unit) for unit in UNIT_TEXTS
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
_NEWLINE_AND_INDENT = re.compile(r"\n\s*")
_VARIABLE_PREFIXES = ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to")


def _words_to_number(s: str) -> str:
    """`two` -> `2`, `point five` -> `0.5` (word2number, as the reference); unchanged when it fails."""
    try:
        return str(w2n.word_to_num(s))
    except Exception:  # the reference swallows every failure of word2number
        return s


def _remove_units(s: str) -> str:
    for _ in range(2):
        for pattern, literal in _UNIT_PATTERNS:
            if literal is not None and literal not in s:
                continue
            without = pattern.sub(r"\1\2", s)
            if without != "":
                s = without
    return s


def strip_string(string: object, skip_unit: bool = False) -> str:
    r"""Qwen2.5-Math `strip_string`: canonicalise an extracted answer (units, `\text`, `\left`, fractions...).

    The reference's bracket unwrapping (`{..}`/`(..)`/`[..]` when the whole string `isalnum()`) can never
    fire and its quote removal discards its result; both are omitted.
    """
    s = str(string).strip()
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
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
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
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else ""


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
