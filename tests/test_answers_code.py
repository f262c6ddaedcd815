"""corl_jax.answers.code: reference semantics of the code vote key and GT grading (spec §3.4), and
a sandbox that neither leaks nor hangs the caller under hostile completions."""

import ast
import ctypes
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
    SandboxLimits,
    extract_calls,
    extract_code,
    passes_tests,
    passes_tests_batch,
    run_outputs,
    sandbox_confinement,
    voting_answer,
)

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


def read_ppid(pid: int) -> int | None:
    """Parent pid of `pid` in any state (zombies included); None when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def runner_pids() -> list[int]:
    return [pid for pid, _, cmdline in live_processes() if str(RUNNER).encode() in cmdline]


def sandbox_processes() -> list[int]:
    """Live runner processes (and their forks) plus children of this test process."""
    return [pid for pid, ppid, cmdline in live_processes()
            if str(RUNNER).encode() in cmdline or ppid == os.getpid()]


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """No sandbox process started during the test outlives it (runners are matched by this
    checkout's path; those already running belong to other test processes). A killed pid 1 of a
    PID namespace is reaped by init, not by us, so it may take a moment to go."""
    before = set(sandbox_processes())
    yield
    deadline = time.monotonic() + 10
    while (left := set(sandbox_processes()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left


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


# A completion that fails its test and tries to report a pass anyway. Each forge runs at module
# level (before the tests) and/or from the failing test itself.
FORGES = {
    "print the marker": "import sys\nprint('<PASS>')\nprint('\"<PASS>\"', file=sys.__stdout__)",
    "old results file": "import os\nopen('results.jsonl', 'a').write('\"<PASS>\"\\n')\nos._exit(0)",
    "lines on every fd": """
        import base64, os
        line = b"1 " + base64.b64encode(b"<PASS>") + b" " + b"0" * 32 + b"\\n"
        for fd in range(64):
            try:
                os.write(fd, line)
            except OSError:
                pass
        os._exit(0)""",
    "replay a genuine line": """
        import os
        for fd in range(3, 64):
            try:
                first = os.pread(fd, 4096, 0).split(b"\\n")[0]
            except OSError:
                continue
            if first[:2] == b"0 ":
                os.write(fd, first + b"\\n" + b"1" + first[1:] + b"\\n")
        os._exit(0)""",
    "exit 0 in the test": "import os\ndef check():\n    os._exit(0)",
    "sys.exit in the test": "import sys\ndef check():\n    sys.exit(0)",
    "SystemExit in __del__": """
        class Bomb:
            def __del__(self):
                raise SystemExit(0)
        def check():
            Bomb()""",
    "patch the checker": """
        import base64, binascii, builtins, hashlib, json, os, __main__
        __main__.marker = lambda exc: "<PASS>"
        __main__.run_tests = lambda job, record: record("<PASS>")
        json.dumps = lambda value: '"<PASS>"'
        builtins.isinstance = lambda value, kind: False
        builtins.callable = lambda value: value is not None
        real_write = os.write
        os.write = lambda fd, data: real_write(fd, data.replace(
            base64.b64encode(b"<ERR:AssertionError>"), base64.b64encode(b"<PASS>")))
        binascii.b2a_base64 = lambda data, newline=True: base64.b64encode(b"<PASS>")
        hashlib.blake2b = lambda *args, **kwargs: hashlib.sha256(b"")""",
    "raise from the timer": """
        import signal
        def check():
            signal.signal(signal.SIGALRM, lambda *args: None)
            signal.setitimer(signal.ITIMER_REAL, 0)""",
}


def test_erasing_its_records_is_a_failure_not_a_sandbox_error():
    source = """
    import os
    def f():
        for fd in range(3, 64):
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
        return 1
    """
    assert run_outputs(textwrap.dedent(source), "f", [(), ()], limits=FAST) == [
        "<ERR:SandboxExit>"] * 2  # the second call erased the first's record, the runner's write
    # of its own then follows a hole: neither verifies
    # in passes_tests nothing is recorded before the verdict, so there is nothing to erase
    assert passes_tests(fenced(source), "def test_x():\n    assert f() == 1", limits=FAST)


@pytest.mark.parametrize("name", FORGES)
def test_a_failing_completion_cannot_forge_a_pass(name):
    forge = textwrap.dedent(FORGES[name]).strip()
    solution = f"{forge}\ndef f():\n    return 2"
    tests = "def test_value():\n    check()\n    assert f() == 1" if "def check" in forge \
        else "def test_value():\n    assert f() == 1"
    assert not passes_tests(fenced(solution), tests, limits=FAST)
    # the same completion passes once its value is right: the forge itself breaks nothing
    if name not in ("old results file", "lines on every fd", "replay a genuine line",
                    "exit 0 in the test", "sys.exit in the test"):
        assert passes_tests(fenced(solution.replace("return 2", "return 1")), tests, limits=FAST)


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
    source = ("import os\ndef f():\n    os.mkdir('sub')\n    open('sub/a.txt', 'w').write('hi')\n"
              "    return os.getcwd(), open('sub/a.txt').read()")
    workdir, content = ast.literal_eval(run_one(source))
    assert content == "hi" and os.path.basename(workdir).startswith("corl_sandbox_")
    assert not os.path.exists(workdir)


def test_temp_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_one("def f():\n    open('junk', 'w').write('x' * 1000)\n    return 1")
    run_one("def f():\n    while True:\n        pass")
    assert list(tmp_path.iterdir()) == []


def test_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("CORL_SECRET", "xyz")
    assert run_one("import os\ndef f():\n    return os.environ.get('CORL_SECRET')") == "None"
    keys = ast.literal_eval(run_one("import os\ndef f():\n    return sorted(os.environ)"))
    assert set(keys) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONHASHSEED", "OMP_NUM_THREADS",
                         "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}


# Ways to read the trainer's (this process's) environment or command line through /proc.
PROC_ESCAPES = {
    "path": "open('/proc/{pid}/environ', 'rb').read()",
    "cmdline": "open('/proc/{pid}/cmdline', 'rb').read()",
    "dotdot": "open('/proc/self/../{pid}/environ', 'rb').read()",
    "root link": "open('/proc/self/root/proc/{pid}/environ', 'rb').read()",
    "dir_fd proc": "os.read(os.open('{pid}/environ', os.O_RDONLY, "
                   "dir_fd=os.open('/proc', os.O_RDONLY)), 1 << 16)",
    "dir_fd root": "os.read(os.open('proc/{pid}/cmdline', os.O_RDONLY, "
                   "dir_fd=os.open('/', os.O_RDONLY | os.O_DIRECTORY)), 1 << 16)",
    "dir_fd self": "os.read(os.open('../{pid}/environ', os.O_RDONLY, "
                   "dir_fd=os.open('/proc/self', os.O_PATH)), 1 << 16)",
    "chdir": "(os.chdir('/proc'), open('{pid}/environ', 'rb').read())",
}


@pytest.mark.parametrize("name", PROC_ESCAPES)
def test_other_processes_proc_entries_are_unreadable(name):
    expression = PROC_ESCAPES[name].format(pid=os.getpid())  # the sandbox's parent
    assert run_one(f"import os\ndef f():\n    return {expression}") == "<ERR:PermissionError>"


@pytest.fixture
def without_landlock(tmp_path, monkeypatch):
    """The sandbox as on a kernel without Landlock: a copy of the runner whose Landlock syscall
    numbers do not exist (ENOSYS), so a PID namespace and the audit hook guard /proc."""
    source = RUNNER.read_text()
    numbers = ("_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = "
               "444, 445, 446")
    assert numbers in source
    runner = tmp_path / RUNNER.name
    runner.write_text(source.replace(numbers, numbers.replace("444, 445, 446", "-1, -1, -1")))
    monkeypatch.setattr(code_answers, "_RUNNER", runner)
    layers = sandbox_confinement(FAST)
    assert layers["landlock_abi"] == 0
    if not layers["pid_namespace"]:
        pytest.skip("no PID namespace for this user here")


def test_without_landlock_a_pid_namespace_hides_other_processes(without_landlock):
    source = ("import os\ndef f():\n"
              "    return os.getpid(), [e for e in os.listdir('/proc') if e.isdigit()]")
    assert run_one(source) == "(1, ['1'])"
    for name, expression in PROC_ESCAPES.items():
        attack = f"import os\ndef f():\n    return {expression.format(pid=os.getpid())}"
        assert run_one(attack) == "<ERR:PermissionError>", name


def test_own_proc_entries_and_ordinary_files_stay_readable():
    source = """
    import os, sys
    def f():
        status = open('/proc/self/status').read()
        return (f"Pid:\\t{os.getpid()}" in status, len(open(sys.executable, 'rb').read(4)),
                len(os.listdir(os.path.dirname(os.__file__))) > 10)
    """
    assert run_one(source) == "(True, 4, True)"


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


# ------------------------------------------------------------------------ each layer alone


def probe_layer(tmp_path, setup: str, attempts: dict[str, str]) -> dict:
    """Run `setup` (a call into the runner module, imported as `runner`) in a fresh interpreter
    whose parent is this process, then each attempt; {name: "allowed" or the errno, 0 for a
    PermissionError without one (the audit hook's), "refused" for a failed assert}."""
    probe = textwrap.dedent(f"""
        import importlib.util, json, os, socket, threading
        spec = importlib.util.spec_from_file_location("runner", {str(RUNNER)!r})
        runner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(runner)
        exec({setup!r})
        results = {{}}
        for name, source in json.loads({json.dumps(json.dumps(attempts))}).items():
            os.chdir({str(tmp_path)!r})  # undo an attempt's chdir
            try:
                exec(source, globals())
                results[name] = "allowed"
            except OSError as error:
                results[name] = error.errno or 0
            except AssertionError:
                results[name] = "refused"
        print(json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-S", "-P", "-c", probe], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


PROC_ATTEMPTS = {name: f"import os\n{expression.format(pid=os.getpid())}"
                 for name, expression in PROC_ESCAPES.items()}


def test_kernel_layers_refuse_escapes_without_the_audit_hook(tmp_path):
    """The runner's kernel confinement on its own (no audit hook): fork, exec, sockets, signals
    to the parent, writes outside the directory and reads of the parent's /proc entries fail in
    the kernel (ENOENT in a PID namespace); threads, own /proc entries and ordinary reads still
    work."""
    layers = sandbox_confinement(FAST)
    if not layers["landlock_abi"] or not layers["seccomp"]:
        pytest.skip(f"kernel layers unavailable here: {layers}")
    outside = f"/tmp/corl_pwned_{uuid.uuid4().hex}"
    attempts = {
        "fork": "os.fork()",
        "exec": "os.execv('/bin/true', ['true'])",
        "socket": "socket.socket()",
        "kill parent": "os.kill(os.getppid(), 0)",
        "write outside": f"open({outside!r}, 'w')",
        # EINVAL / success without the filter; a harmless target either way
        "umount": f"runner._checked(runner._libc().umount2({str(tmp_path)!r}.encode(), 2))",
        "chroot": f"os.chroot({str(tmp_path)!r})",
        **PROC_ATTEMPTS,
        "write inside": f"open({str(tmp_path / 'ok')!r}, 'w').close()",
        "signal self": "os.kill(os.getpid(), 0)",
        "read own proc": "open('/proc/self/status').read()",
        "read a file": "open(os.__file__).read()",
        "thread": "thread = threading.Thread(target=print)\nthread.start()\nthread.join()",
    }
    results = probe_layer(tmp_path, f"runner.confine_kernel({str(tmp_path)!r})", attempts)
    refused = {name: value for name, value in results.items()
               if name not in ("write inside", "signal self", "read own proc", "read a file",
                               "thread")}
    assert all(value in (errno.EPERM, errno.EACCES, errno.ENOENT)
               for value in refused.values()), results
    assert {results[name] for name in ("write inside", "signal self", "read own proc",
                                       "read a file", "thread")} == {"allowed"}, results
    assert not os.path.exists(outside)


LAYERS_ALONE = {
    "pid namespace": "available = runner.enter_pid_namespace(runner._libc(), False)",
    "pid and user namespaces": "available = runner.enter_pid_namespace(runner._libc(), True)",
    "landlock": "libc = runner._libc()\nrunner._checked(libc.prctl(38, 1, 0, 0, 0))\n"
                "available = runner.restrict_landlock(libc, {workdir!r})",
    "audit hook": "available = runner.install_guard({workdir!r}) is None",
}


@pytest.mark.parametrize("layer", LAYERS_ALONE)
def test_each_layer_alone_hides_other_processes(tmp_path, layer):
    """Each of the layers that guard /proc, on its own, refuses every escape to the parent's
    environ and cmdline, while the process's own /proc entries and its working directory stay
    usable (the audit hook: through directory descriptors too)."""
    setup = LAYERS_ALONE[layer].format(workdir=str(tmp_path))
    attempts = {"available": "assert available", **PROC_ATTEMPTS,
                "read own proc": "open('/proc/self/status').read()",
                "dir_fd inside": "os.mkdir('d')\nos.close(os.open('d', os.O_RDONLY))"}
    results = probe_layer(tmp_path, setup, attempts)
    if results.pop("available") != "allowed":
        pytest.skip(f"{layer} is not available here")
    assert results.pop("read own proc") == results.pop("dir_fd inside") == "allowed", results
    assert "allowed" not in results.values(), results


def test_pid_namespace_falls_back_in_place_when_proc_cannot_be_mounted(tmp_path):
    """Where a fresh /proc cannot be mounted, the runner goes on as the calling process (its pid
    matching /proc), not as a pid 1 that would see other processes' entries under its own pid."""
    setup = textwrap.dedent("""
        real, pid_before = runner._libc(), os.getpid()
        class NoProcMount:
            unshare = real.unshare
            def mount(self, source, *args):
                return -1 if source == b"proc" else real.mount(source, *args)
        entered = runner.enter_pid_namespace(NoProcMount(), False)
    """)
    attempts = {"not entered": "assert not entered",
                "same process": "assert os.getpid() == pid_before != 1",
                "own proc": "assert f'Pid:\\t{os.getpid()}' in open('/proc/self/status').read()",
                "SIGTERM kills": "import signal\nassert signal.getsignal(signal.SIGTERM) == 0"}
    results = probe_layer(tmp_path, setup, attempts)
    assert set(results.values()) == {"allowed"}, results


def test_a_sandbox_killed_at_its_wall_limit_leaves_no_orphan(without_landlock):
    """The pid 1 of the sandbox's PID namespace is killed and reaped by the runner's waiting half,
    not orphaned to init (a trainer that is a container's pid 1 would collect it as a zombie).
    This process becomes the subreaper for the test, so an orphan would show as its child."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        source = """
        import signal
        def f():
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                pass
        """
        assert run_one(source) == "<TIMEOUT>"
    finally:
        libc.prctl(36, 0, 0, 0, 0)
    orphans = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
               if read_ppid(pid) == os.getpid()]
    for pid in orphans:
        os.waitpid(pid, 0)
    assert orphans == []
