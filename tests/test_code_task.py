"""task="code" (spec §3.4, §1.9): HumanEval test inputs, vote keys and rewards of the composed `CodeTask.score`
against a naive in-process re-implementation of the reference on hand-written (trusted) completions, pass@1 eval,
the `humaneval` source and the config checks. The `:tiny` run of configs/code_pair.py is in test_train.py."""

import collections
import contextlib
import io
import re
import signal
import textwrap

import ml_collections
import pytest

from config_files import load_config
from corl_jax.answers import code as code_answers
from corl_jax.config import validate
from corl_jax.data import Problem, load_problems
from corl_jax.tasks import CodeTask

CALL_SECONDS = 0.5


def task() -> CodeTask:
    return CodeTask(ml_collections.ConfigDict({"call_seconds": CALL_SECONDS, "test_seconds": 2.0,
                                               "sandbox_workers": 2}))


# ------------------------------------------------------------------------- the naive oracle (spec §3.4, in process)


class _Alarm(Exception):
    pass


def naive_outputs(code: str, func_name: str, inputs) -> list[str]:
    """The reference's `run_outputs`, plainly: exec afresh per input under a SIGALRM timer, stdout swallowed."""

    def on_alarm(signum, frame):
        raise _Alarm()

    outputs = []
    for args in inputs:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
        try:
            namespace = {}
            with contextlib.redirect_stdout(io.StringIO()):
                exec("from typing import *\n" + code, namespace)
                func = namespace.get(func_name)
                outputs.append("<NOFUNC>" if func is None else repr(func(*args)))
        except _Alarm:
            outputs.append("<TIMEOUT>")
        except SystemExit as e:
            outputs.append(f"<ERR:SystemExit:{e.code}>")
        except BaseException as e:  # noqa: B036
            outputs.append(f"<ERR:{type(e).__name__}>")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return outputs


def naive_key(text: str, func_name: str, inputs) -> str | None:
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)```", text, re.DOTALL)
    code = (blocks[-1] if blocks else text).strip()
    if not code or not inputs:
        return None
    outputs = naive_outputs(code, func_name, inputs)
    return None if all(o.startswith("<") for o in outputs) else repr(tuple(outputs))


def naive_rewards(keys_a, keys_b, g):
    """Pair topology: each agent's keys against the peer's plurality key (first seen on ties; None unlabeled)."""

    def label(keys):
        counts = collections.Counter(k for k in keys if k is not None)
        return counts.most_common(1)[0][0] if counts else None

    out = []
    for mine, peer in ((keys_a, keys_b), (keys_b, keys_a)):
        rows = []
        for p in range(len(mine) // g):
            teacher = label(peer[p * g:(p + 1) * g])
            rows.append([float(k is not None and k == teacher) for k in mine[p * g:(p + 1) * g]])
        out.append(rows)
    return out


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(source).strip()}\n```\nDone."


# HumanEval style (entry point + check(candidate)) and CoMAS style (asserts on the function, test* functions).
HUMANEVAL = Problem(id=0, text="add two numbers", source="mem", entry_point="add", answer=textwrap.dedent("""
    METADATA = {}

    def check(candidate):
        assert candidate(2, 3) == 5
        assert abs(candidate(0.5, 0.25) - 0.75) < 1e-6
        assert candidate(x=1, y=2) == 3        # keyword: skipped
        assert candidate(*[1, 2]) == 3         # starred: skipped
        for v in range(3):
            assert candidate(v, v) == 2 * v    # not literal: skipped
        assert candidate(-4, [1][0]) == -3     # not literal: skipped
        assert candidate(-1, 1) == 0
    """), canonical_solution="def add(x, y):\n    return x + y\n")
COMAS = Problem(id=1, text="reverse a list", source="mem", canonical_solution=None, answer=textwrap.dedent("""
    assert rev([1, 2, 3]) == [3, 2, 1]
    assert rev([]) == []

    def test_more():
        assert rev(["a", "b"]) == ["b", "a"]
    """))

ADD_RIGHT = fenced("def add(x, y):\n    return x + y")
ADD_RIGHT_OTHER = "```python\ndef add(a, b):\n    print('thinking', a, b)\n    return b + a\n```"  # same outputs
ADD_WRONG = fenced("def add(x, y):\n    return x - y")
ADD_CRASH = fenced("def add(x, y):\n    return x / 0")
ADD_LOOP = fenced("def add(x, y):\n    while True:\n        pass")
ADD_PARTIAL = fenced("def add(x, y):\n    if x < 0:\n        raise ValueError(x)\n    return x + y")
ADD_HOSTILE = fenced("""
    import sys
    def add(x, y):
        print('{"forged": true}\\n"<TIMEOUT>"')
        sys.__stdout__.write('"(\\'5\\',)"\\n')
        sys.__stdout__.flush()
        return x + y + 1
    """)
GARBAGE = "def add(x y):: ]]\x00 return"
REV_RIGHT = fenced("def rev(xs):\n    return list(reversed(xs))")
REV_WRONG = fenced("def rev(xs):\n    return xs")
REV_EXIT = fenced("import sys\ndef rev(xs):\n    sys.exit(3)")
REV_NOFUNC = fenced("def reverse(xs):\n    return xs[::-1]")


def test_candidate_calls_reads_literal_arguments_of_the_asserts():
    assert code_answers.candidate_calls(HUMANEVAL.answer) == [(2, 3), (0.5, 0.25), (-1, 1)]
    assert code_answers.candidate_calls("def check(candidate):\n    assert candidate(") == []  # not Python
    [real] = [p for p in load_problems("humaneval") if p.entry_point == "truncate_number"]
    assert code_answers.candidate_calls(real.answer) == [(3.5,), (1.33,), (123.456,)]


def test_vote_keys_and_rewards_equal_the_naive_reference():
    t = task()
    g = 4
    texts_a = [ADD_RIGHT, ADD_WRONG, ADD_CRASH, ADD_LOOP,
               REV_RIGHT, REV_WRONG, REV_EXIT, GARBAGE]
    texts_b = [ADD_RIGHT_OTHER, ADD_HOSTILE, ADD_PARTIAL, "",
               REV_WRONG, REV_NOFUNC, REV_RIGHT, REV_WRONG]
    problems = [HUMANEVAL, COMAS]
    per_completion = [p for p in problems for _ in range(g)]
    # CoMAS: module-level asserts first, then those inside test functions (ast.walk order, as the reference)
    calls = [("add", [(2, 3), (0.5, 0.25), (-1, 1)]), ("rev", [([1, 2, 3],), ([],), (["a", "b"],)])]
    assert [t.calls(p) for p in problems] == calls

    expected = [[naive_key(text, *calls[i // g]) for i, text in enumerate(texts)] for texts in (texts_a, texts_b)]
    keys = [t.vote_keys(texts, per_completion) for texts in (texts_a, texts_b)]
    assert keys == expected
    # Spot checks of the oracle itself: equal outputs give one key; errors and timeouts are markers in the tuple,
    # all-marker runs and text without code are unlabeled; prints never reach the key.
    right = repr(("5", "0.75", "0"))
    assert expected[0][:4] == [right, repr(("-1", "0.25", "-2")), None, None]
    assert expected[1][:4] == [right, repr(("6", "1.75", "1")), repr(("5", "0.75", "<ERR:ValueError>")), None]
    assert expected[0][6] is None and expected[0][7] is None and expected[1][5] is None  # exit, garbage, nofunc

    result = t.score([texts_a, texts_b], problems, topology="pair", threshold=0.0, step=7, agent_names=["a", "b"])
    assert result.rewards.tolist() == naive_rewards(*expected, g)
    assert result.labels == [[right, repr(("[3, 2, 1]", "[]", "['b', 'a']"))],
                             [right, repr(("[1, 2, 3]", "[]", "['a', 'b']"))]]
    # The oracle key is the canonical solution's (HumanEval); COMAS has none.
    assert [r["gt"] for r in result.records[:2]] == [right, None]
    assert result.metrics["a"]["co_labeling/oracle_accuracy_me"] == 0.5  # of 2 labels, the add one is right


def test_eval_is_pass_at_1_of_the_problems_tests():
    t = task()
    texts = [ADD_RIGHT, ADD_WRONG, GARBAGE, REV_RIGHT, REV_WRONG]
    assert t.eval_correct(texts, [HUMANEVAL] * 3 + [COMAS] * 2) == [True, False, False, True, False]


def test_unparsable_code_is_a_syntax_marker_without_a_sandbox(monkeypatch):
    sandboxed = code_answers._run_sandboxed({"mode": "calls", "code": "def f(:\n", "func_name": "f",
                                             "inputs": [(1,)], "preload": []}, 1, code_answers.VOTE_LIMITS)[1]
    monkeypatch.setattr(code_answers, "_run_sandboxed", None)  # any sandbox start would now fail
    assert code_answers.run_outputs("def f(:\n", "f", [(1,), (2,)]) == sandboxed * 2 == ["<ERR:SyntaxError>"] * 2
    assert code_answers.run_outputs("  x = 1", "f", [(1,)]) == ["<ERR:IndentationError>"]
    assert code_answers.passes_tests("def f(:", "def test_f():\n    pass") is False


def test_humaneval_source_holds_the_164_problems():
    problems = load_problems("humaneval")
    assert len(problems) == 164 and all(p.entry_point and p.canonical_solution for p in problems)
    assert problems[0].text.startswith("Complete the following Python function.\n```python\n")
    assert "def check(candidate)" in problems[0].answer


@pytest.mark.parametrize("override, message", [
    ({"task": "coding"}, "config.task: unknown task 'coding'"),
    ({"method": "gt_reward"}, "config.method: gt_reward has no code reward"),
    ({"code.call_seconds": 0.0}, "config.code.call_seconds: 0.0 is not positive"),
    ({"code.sandbox_workers": -1}, "config.code.sandbox_workers: negative"),
])
def test_bad_code_settings_are_named(override, message):
    config = load_config("code_pair", "tiny")
    for key, value in override.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config)[name] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(config)
