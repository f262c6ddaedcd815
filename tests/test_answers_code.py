"""corl_jax.answers.code: reference semantics of the code vote key and GT grading (spec §3.4), and
a sandbox that neither leaks nor hangs the caller under hostile completions."""

import ast
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from corl_jax.answers import code as code_answers
from corl_jax.answers.code import (
    SandboxLimits, extract_calls, extract_code, passes_tests, passes_tests_batch, run_outputs,
    sandbox_confinement, voting_answer)

# Small limits keep the suite fast: per-call timer 1 s, whole child 2.5 s, 512 MiB, 64 KiB files.
FAST = SandboxLimits(call_seconds=1.0, wall_seconds=2.5, memory_bytes=512 << 20,
                     max_output_bytes=64 << 10)
RUNNER = Path(code_answers.__file__).with_name("_sandbox_runner.py")


def fenced(source: str) -> str:
    return f"Here is my solution.\n```python\n{textwrap.dedent(source).strip()}\n```\nDone."


def run_one(source: str, *args, limits=FAST) -> str:
    """Run `f(*args)` of `source` in the sandbox; the single output."""
    [output] = run_outputs(textwrap.dedent(source), "f", [args], limits=limits)
    return output


def live_processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every live (non-zombie) process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            found.append((int(entry.name), int(ppid), cmdline))
    return found


def runner_pids() -> list[int]:
    return [pid for pid, _, cmdline in live_processes() if RUNNER.name.encode() in cmdline]


def sandbox_processes() -> list[int]:
    """Live runner processes (and their forks) plus children of this test process."""
    return [pid for pid, ppid, cmdline in live_processes()
            if RUNNER.name.encode() in cmdline or ppid == os.getpid()]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    assert sandbox_processes() == []


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1"),
    ("a\n```python\nx = 1\n```\nb\n```python\n  y = 2  \n```\n", "y = 2"),  # the last block
    ("```\nz = 3\n```", "z = 3"),  # plain fence
    ("  def g(): pass  \n", "def g(): pass"),  # no fence: whole text, stripped
    ("```python\n   \n```", None),
    ("   \n", None),
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_extract_code_rejects_non_text():
    with pytest.raises(TypeError, match="text must be a str"):
        extract_code(None)


def test_extract_calls_inputs_in_walk_order_and_last_name():
    test_code = textwrap.dedent("""
        def test_inner():
            assert inner(5) == 6
        assert f(1, 'a') == 2
        assert f([1, 2], {'k': (3,)}), "message"
        assert f(x) == 3
        assert f(1, key=2) == 4
        assert 7 == f(7)
        assert g.method(1) == 1
    """)
    # ast.walk is breadth-first: module-level asserts before the one inside test_inner; `f(x)`
    # (not a literal) is skipped but still counts for the name; keywords are dropped.
    assert extract_calls(test_code) == ("inner", [(1, "a"), ([1, 2], {"k": (3,)}), (1,), (5,)])


@pytest.mark.parametrize("test_code", ["", "def broken(:", "x = 1\nassert x == 1", "\x00"])
def test_extract_calls_without_calls(test_code):
    assert extract_calls(test_code) == (None, [])


# ------------------------------------------------------------------- reference semantics

SOLUTION = """
def f(xs, k):
    print("noise")  # swallowed
    return sorted(xs)[:k] if k >= 0 else {"neg": k}
"""
INPUTS = [([3, 1, 2], 2), ([], 0), ([5.5, -1], -1), (("b", "a"), 1)]


def test_run_outputs_equals_plain_in_process_execution():
    namespace = {}
    exec("from typing import *\n" + SOLUTION, namespace)
    expected = [repr(namespace["f"](*args)) for args in INPUTS]
    assert run_outputs(SOLUTION, "f", INPUTS, limits=FAST) == expected
    assert expected == ["[1, 2]", "[]", "{'neg': -1}", "['a']"]


def test_voting_answer_is_repr_of_output_tuple():
    test_code = "\n".join(f"assert f{args!r} == None" for args in INPUTS)
    assert voting_answer(fenced(SOLUTION), test_code, limits=FAST) == repr(
        ("[1, 2]", "[]", "{'neg': -1}", "['a']"))


def test_error_markers():
    source = """
    import sys
    def f(x):
        if x == 0:
            return 1 / x
        if x == 1:
            sys.exit(3)
        if x == 2:
            raise KeyboardInterrupt
        if x == 3:
            while True:
                pass
        return x
    """
    outputs = run_outputs(textwrap.dedent(source), "f", [(0,), (1,), (2,), (3,), (4,)], limits=FAST)
    assert outputs == ["<ERR:ZeroDivisionError>", "<ERR:SystemExit:3>",
                       "<ERR:KeyboardInterrupt>", "<TIMEOUT>", "4"]
    assert run_outputs("def g(x):\n    return x", "f", [(1,)], limits=FAST) == ["<NOFUNC>"]
    assert run_outputs("def f(:", "f", [(1,), (2,)], limits=FAST) == ["<ERR:SyntaxError>"] * 2


def test_code_runs_afresh_for_every_input():
    source = "calls = []\ndef f(x):\n    calls.append(x)\n    return len(calls)"
    assert run_outputs(source, "f", [(1,), (2,)], limits=FAST) == ["1", "1"]


def test_caught_timer_is_caught_like_the_reference():
    source = """
    def f(x):
        try:
            while True:
                pass
        except Exception:
            return "rescued"
    """
    assert run_one(source, 0) == "'rescued'"


def test_voting_answer_none_cases():
    assert voting_answer("   ", "assert f(1) == 1", limits=FAST) is None  # no code
    assert voting_answer(fenced("def f(x): return x"), "x = 1", limits=FAST) is None  # no calls
    all_errors = fenced("def f(x): return 1 / 0")
    assert voting_answer(all_errors, "assert f(1) == 1\nassert f(2) == 2", limits=FAST) is None
    some_errors = fenced("def f(x): return 1 / (x - 1)")
    assert voting_answer(some_errors, "assert f(1) == 0\nassert f(2) == 1", limits=FAST) == repr(
        ("<ERR:ZeroDivisionError>", "1.0"))


def test_long_outputs_keep_equality_but_are_shortened():
    source = "def f(n, tail):\n    return 'x' * n + tail"
    a, b, c = run_outputs(source, "f", [(100_000, "a"), (100_000, "a"), (100_000, "b")],
                          limits=FAST)
    assert a == b != c
    assert len(a) < 2 * code_answers.MAX_REPR_CHARS and a.startswith("'xxx")


def test_set_reprs_agree_across_sandboxes():
    source = "def f(n):\n    return {f'item{i}' for i in range(n)}"
    first, second = (run_one(source, 40) for _ in range(2))
    assert first == second and ast.literal_eval(first) == {f"item{i}" for i in range(40)}


def test_stdlib_is_not_shadowed_by_package_modules():
    # corl_jax/answers/math.py sits next to the runner script; `import math` must be the stdlib.
    assert run_one("import math\ndef f(x):\n    return math.isqrt(x)", 17) == "4"


# ------------------------------------------------------------------------- passes_tests


TESTS = """
import pytest

def test_values():
    assert f([3, 1, 2], 2) == [1, 2]

def test_raises():
    with pytest.raises(TypeError):
        f(None, 1)
"""


@pytest.mark.parametrize("solution, expected", [
    (SOLUTION, True),
    ("def f(xs, k):\n    return xs[:k]", False),  # wrong values
    ("def f(xs, k):\n    return sorted(xs or [])[:k]", False),  # pytest.raises: DID NOT RAISE
    ("import sys\nsys.exit(0)", False),
    ("def f(xs, k):\n    while True:\n        pass", False),  # timeout
    ("", False),  # no code
])
def test_passes_tests(solution, expected):
    text = fenced(solution) if solution else ""
    assert passes_tests(text, TESTS, limits=FAST) is expected


def test_passes_tests_needs_a_test_function():
    assert not passes_tests(fenced(SOLUTION), "assert f([1], 1) == [1]", limits=FAST)
    assert not passes_tests(fenced(SOLUTION), "", limits=FAST)


def test_batches_match_single_calls():  # vote keys in batches: tests/test_code_task.py (CodeTask.vote_keys)
    texts = [fenced(SOLUTION), fenced("def f(xs, k):\n    return xs"), "no code at all", ""]
    assert passes_tests_batch(texts, [TESTS] * 4, limits=FAST) == [True, False, False, False]
    with pytest.raises(ValueError, match="pair up one to one"):
        passes_tests_batch(texts, [TESTS], limits=FAST)


@pytest.mark.parametrize("field, value", [("call_seconds", 0), ("memory_bytes", -1),
                                          ("wall_seconds", 0.0), ("max_processes", 0)])
def test_limits_reject_non_positive(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} must be positive"):
        SandboxLimits(**{field: value})


def test_limits_cpu_seconds_must_be_whole():
    with pytest.raises(TypeError, match="cpu_seconds must be an int"):
        SandboxLimits(cpu_seconds=1.5)


def test_runner_failure_is_loud(tmp_path, monkeypatch):
    monkeypatch.setattr(code_answers, "_RUNNER", tmp_path / "missing_runner.py")
    with pytest.raises(code_answers.SandboxError, match="did not start"):
        run_outputs("def f(): return 1", "f", [()], limits=FAST)


# ------------------------------------------------------------------------------ sandbox


def test_infinite_loop_that_swallows_the_timer_is_killed():
    source = """
    import signal
    def f(x):
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
    """
    start = time.monotonic()
    outputs = run_outputs(textwrap.dedent(source), "f", [(1,), (2,)], limits=FAST)
    assert outputs == ["<TIMEOUT>", "<TIMEOUT>"]
    assert time.monotonic() - start < 30  # returned (the wall limit is 2.5 s), no hang


@pytest.mark.parametrize("bomb", [
    "import os\ndef f():\n    while True:\n        os.fork()",
    "import subprocess\ndef f():\n    while True:\n        subprocess.Popen(['sleep', '60'])",
    "import os\ndef f():\n    while True:\n        os.posix_spawn('/bin/true', ['true'], {})",
    "import _posixsubprocess\ndef f():\n    return _posixsubprocess.fork_exec()",
    "import subprocess\ndef f():\n    return subprocess._fork_exec()",
    "import ctypes\ndef f():\n    libc = ctypes.CDLL(None)\n    while True:\n        libc.fork()",
    "import multiprocessing\ndef f():\n    p = multiprocessing.Process(target=f)\n    p.start()",
])
def test_fork_bombs_are_contained(bomb):
    assert run_one(bomb) == "<ERR:PermissionError>"
    # the autouse fixture then checks that no runner or child process survives


def test_memory_bomb_is_an_error_marker():
    assert run_one("def f():\n    return len(bytearray(10 * 10**9))") == "<ERR:MemoryError>"
    assert run_one("def f():\n    return len([0] * (10 * 10**9 // 8))") == "<ERR:MemoryError>"


def test_huge_output_is_capped():
    source = """
    import os, sys
    def f():
        chunk = "x" * (1 << 20)
        for _ in range(1024):  # 1 GiB through print (swallowed) and to fd 1 (/dev/null)
            print(chunk)
            os.write(1, chunk.encode())
        written = 0
        try:
            for _ in range(1024):  # 1 GiB to stderr: a file capped at max_output_bytes
                written += os.write(2, chunk.encode())
        except OSError as error:
            return ("capped", written, error.errno)
    """
    assert run_one(source) == repr(("capped", FAST.max_output_bytes, errno.EFBIG))


def test_writes_outside_the_workdir_fail(tmp_path):
    target = f"/tmp/corl_pwned_{uuid.uuid4().hex}"
    attempts = [
        f"def f():\n    open({target!r}, 'w').write('x')",
        f"import os\ndef f():\n    os.open({target!r}, os.O_CREAT | os.O_WRONLY)",
        f"import pathlib\ndef f():\n    pathlib.Path({target!r}).write_text('x')",
        f"import os\ndef f():\n    os.symlink({target!r}, 'link')\n    open('link', 'w')",
        f"import os\ndef f():\n    fd = os.open('/tmp', os.O_RDONLY)\n"
        f"    os.open({os.path.basename(target)!r}, os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        f"import os, shutil\ndef f():\n    shutil.rmtree({str(tmp_path)!r})",
    ]
    for source in attempts:
        assert run_one(source).startswith("<ERR:"), source
    assert not os.path.exists(target) and tmp_path.exists()
    # inside the working directory writing works, and the directory is removed afterwards
    source = ("import os\ndef f():\n    open('a.txt', 'w').write('hi')\n"
              "    return os.getcwd(), open('a.txt').read()")
    workdir, content = ast.literal_eval(run_one(source))
    assert content == "hi" and os.path.basename(workdir).startswith("corl_sandbox_")
    assert not os.path.exists(workdir)


def test_temp_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_one("def f():\n    open('junk', 'w').write('x' * 1000)\n    return 1")
    run_one("def f():\n    while True:\n        pass")
    assert list(tmp_path.iterdir()) == []


def test_parent_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("CORL_SECRET", "xyz")
    assert run_one("import os\ndef f():\n    return os.environ.get('CORL_SECRET')") == "None"
    keys = ast.literal_eval(run_one("import os\ndef f():\n    return sorted(os.environ)"))
    assert set(keys) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONHASHSEED", "OMP_NUM_THREADS",
                         "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}
    source = "import os\ndef f():\n    return open(f'/proc/{os.getppid()}/environ', 'rb').read()"
    assert run_one(source) == "<ERR:PermissionError>"


@pytest.mark.parametrize("attack", [
    "import os\ndef f():\n    os.kill(os.getppid(), 9)",
    "import os\ndef f():\n    os.killpg(os.getpgid(os.getppid()), 9)",
    "import os\ndef f():\n    os.kill(-os.getpgid(os.getppid()), 9)",
    "import os, signal\ndef f():\n    os.kill(0, 9)\n    return 'alive'",
])
def test_the_parent_cannot_be_killed(attack):
    assert run_one(attack).startswith("<ERR:")
    assert os.getpid() > 0  # still here


def test_sockets_are_refused():
    source = "import socket\ndef f():\n    return socket.create_connection(('127.0.0.1', 9))"
    assert run_one(source) == "<ERR:PermissionError>"


def test_sandbox_exits_when_its_parent_dies(tmp_path):
    # A parent process starts a sandbox that sleeps under long limits, then is SIGKILLed: the
    # runner must notice (stdin EOF) and exit instead of running on as an orphan.
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, tempfile
        sys.path.insert(0, {str(Path(code_answers.__file__).parents[2])!r})
        tempfile.tempdir = {str(tmp_path)!r}  # a killed parent cannot remove its sandbox dir
        from corl_jax.answers.code import SandboxLimits, run_outputs
        source = "import time\\ndef f():\\n    time.sleep(60)"
        run_outputs(source, "f", [()], limits=SandboxLimits(call_seconds=60, wall_seconds=60))
    """))
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 20
    while not runner_pids():
        assert time.monotonic() < deadline, "the sandbox never started"
        time.sleep(0.05)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while sandbox_processes():
        assert time.monotonic() < deadline, "an orphaned sandbox survived its parent"
        time.sleep(0.05)


# --------------------------------------------------------------------- kernel layers alone


def test_kernel_layers_refuse_escapes_without_the_audit_hook(tmp_path):
    """The runner's kernel confinement on its own (no audit hook): fork, exec, sockets, signals
    to the parent and writes outside the directory fail in the kernel; threads still work."""
    layers = sandbox_confinement(FAST)
    if not layers["landlock_abi"] or not layers["seccomp"]:
        pytest.skip(f"kernel layers unavailable here: {layers}")
    outside = f"/tmp/corl_pwned_{uuid.uuid4().hex}"
    probe = textwrap.dedent(f"""
        import importlib.util, json, os, socket, threading
        spec = importlib.util.spec_from_file_location("runner", {str(RUNNER)!r})
        runner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(runner)
        runner.confine_kernel({str(tmp_path)!r})
        results = {{}}
        def attempt(name, action):
            try:
                action()
                results[name] = "allowed"
            except OSError as error:
                results[name] = error.errno
        attempt("fork", os.fork)
        attempt("exec", lambda: os.execv("/bin/true", ["true"]))
        attempt("socket", socket.socket)
        attempt("kill parent", lambda: os.kill(os.getppid(), 0))
        attempt("write outside", lambda: open({outside!r}, "w"))
        attempt("write inside", lambda: open({str(tmp_path / "ok")!r}, "w").close())
        attempt("signal self", lambda: os.kill(os.getpid(), 0))
        thread = threading.Thread(target=lambda: results.update(thread="ran"))
        thread.start()
        thread.join()
        print(json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-S", "-P", "-c", probe], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    refused = {name: results[name] for name in ("fork", "exec", "socket", "kill parent",
                                                 "write outside")}
    assert all(value in (1, 13) for value in refused.values()), results  # EPERM / EACCES
    assert results["write inside"] == results["signal self"] == "allowed"
    assert results["thread"] == "ran"
    assert not os.path.exists(outside)
