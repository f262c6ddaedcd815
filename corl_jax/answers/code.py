"""Votable answer of a code completion and pass/fail grading against tests (spec §3.4, §1.9).

The reference (`comas/code_reward.py`) execs model code inside the trainer. Here every execution
happens in a sandbox, one child process per completion:

* a separate interpreter (`python -S -P -B` on `_sandbox_runner.py`): no site hooks, no script
  directory on `sys.path` (so `corl_jax/answers/math.py` cannot shadow the stdlib `math`); the
  parent's site-packages are appended so `pytest.raises` in test code still imports;
* a fresh temporary working directory, removed afterwards, also used as HOME and TMPDIR;
* an environment built from scratch (PATH, LANG, thread counts, and PYTHONHASHSEED=0 so that sets of
  strings print in the same order in every sandbox): nothing, secrets included, is inherited;
* resource limits set by the runner before the code runs (hard = soft, except CPU: SIGXCPU then
  SIGKILL): CPU time, address space, file size (also caps the child's stderr and result files),
  open files, no core dumps, process count (RLIMIT_NPROC binds only non-root users);
* its own session (`start_new_session`): on return, or after the wall-clock limit, the whole
  process group is SIGKILLed while the child is still unreaped (no pid reuse race); the parent
  waits on a pidfd, so it never blocks longer than the wall limit; stdout goes to /dev/null, stderr
  to a size-capped file that is read with a bound; the child exits by itself if the parent dies
  (a trainer killed by SIGKILL leaves the working directories of in-flight sandboxes behind);
* kernel confinement where the kernel offers it (`sandbox_confinement()` says what is active):
  no_new_privs; Landlock (writes only beneath the working directory, no TCP, and from ABI 6 no
  signals to processes outside the sandbox); a seccomp filter (x86_64, aarch64) refusing fork,
  vfork, non-thread clone, exec, socket, ptrace, process_vm_*, io_uring, unshare/setns/mount and
  kill/tgkill of any pid but its own;
* an audit hook (`sys.addaudithook`) in the child that refuses the same escapes at the Python
  level on any kernel: fork/exec/spawn/subprocess, signals to other processes, sockets, ctypes
  symbol lookups and raw memory access, imports that bypass the hook (`_posixsubprocess`,
  subinterpreters, CPython test modules), writes outside the working directory, and reads of
  other processes' /proc entries (e.g. the parent's environ, which Landlock does not cover).

Audit hooks are not a security boundary on their own (native code bypasses them, and the child
runs as the trainer's user, root in CI, for which RLIMIT_NPROC does not count); they turn common
escapes into ordinary `<ERR:PermissionError>` markers. The kernel-enforced parts are the process
isolation, the rlimits, the group kill and, where active, Landlock and seccomp. Reading files is
not restricted (the reference could read them too): keep secrets off disks readable by the
trainer's user. Results travel back as JSON lines in the working directory, so determined code
could forge its own records (it could in the reference).

Differences from the reference, all in cases the reference could not survive or bound:
prints are discarded instead of buffered; the per-call timer also covers `repr(result)`;
BaseExceptions other than SystemExit become `<ERR:Name>` instead of crashing; when the whole child
dies (wall limit, CPU limit, `os._exit`, segfault) the calls not yet recorded get `<TIMEOUT>`
(killed) or `<ERR:SandboxExit>` (exited); a repr longer than `MAX_REPR_CHARS` is shortened to its
head plus a SHA-256 of the whole (equal outputs stay equal, keys stay small).
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import math
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_REPR_CHARS = 1024
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")
_RESULTS_FILE = "results.jsonl"  # same name in the runner
_START_UP_SECONDS = 2.0  # wall-clock allowance for the interpreter start on top of the calls
_STDERR_SHOWN_BYTES = 4096
_FENCE = re.compile(r"```(?:python)?\s*\n(.*?)```", re.DOTALL)


class SandboxError(RuntimeError):
    """The sandbox itself failed (the runner did not get ready), as opposed to the code in it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (one completion).

    call_seconds: per-call timer in the child (the reference's SIGALRM): 2 s for votes, 4 s for
        tests.
    wall_seconds: wall clock of the whole child, enforced by the parent; None = call_seconds per
        call plus 2 s of start-up.
    cpu_seconds: RLIMIT_CPU of the child; None = the wall limit rounded up, plus 1.
    memory_bytes: RLIMIT_AS (address space) of the child.
    max_output_bytes: RLIMIT_FSIZE of the child (largest file it can write, its stderr and result
        files included); the parent reads no more than this from either.
    max_processes: RLIMIT_NPROC of the child (binds only when the trainer is not root).
    """

    call_seconds: float = 2.0
    wall_seconds: float | None = None
    cpu_seconds: int | None = None
    memory_bytes: int = 1 << 30
    max_output_bytes: int = 1 << 20
    max_processes: int = 1

    def __post_init__(self):
        for name in ("call_seconds", "wall_seconds", "cpu_seconds", "memory_bytes",
                     "max_output_bytes", "max_processes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {value!r}")
        if self.cpu_seconds is not None and not isinstance(self.cpu_seconds, int):
            raise TypeError(f"SandboxLimits.cpu_seconds must be an int (RLIMIT_CPU counts whole "
                            f"seconds), got {self.cpu_seconds!r}")

    def wall_for(self, n_calls: int) -> float:
        if self.wall_seconds is not None:
            return self.wall_seconds
        return self.call_seconds * max(n_calls, 1) + _START_UP_SECONDS

    def cpu_for(self, n_calls: int) -> int:
        if self.cpu_seconds is not None:
            return self.cpu_seconds
        return math.ceil(self.wall_for(n_calls)) + 1


VOTE_LIMITS = SandboxLimits()
TEST_LIMITS = SandboxLimits(call_seconds=4.0)


def _require_str(value, name: str):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def extract_code(text: str) -> str | None:
    """The last ```python (or plain ```) fenced block, else the whole text; stripped; None when
    empty."""
    _require_str(text, "text")
    blocks = _FENCE.findall(text)
    code = (blocks[-1] if blocks else text).strip()
    return code or None


def extract_calls(test_code: str) -> tuple[str | None, list[tuple]]:
    """(called name, argument tuples) of `assert f(args) == expected` / `assert f(args)` statements.

    Parsed with `ast` only, in `ast.walk` order as the reference (module-level asserts before those
    inside test functions). The name is the last one seen, even when that assert's arguments are
    not literals and are skipped; keyword arguments and expected outputs are ignored.
    """
    _require_str(test_code, "test_code")
    try:
        tree = ast.parse(test_code)
    except Exception:  # noqa: BLE001  SyntaxError, ValueError (NUL bytes), RecursionError
        return None, []
    func_name, call_inputs = None, []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        call = node.test.left if isinstance(node.test, ast.Compare) else node.test
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            func_name = call.func.id
            try:
                call_inputs.append(tuple(ast.literal_eval(arg) for arg in call.args))
            except Exception:  # noqa: BLE001  ValueError/TypeError/RecursionError: not a literal
                pass
    return func_name, call_inputs


def _child_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
            "TMPDIR": workdir, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _wait_for_exit(pid: int, timeout: float) -> bool:
    """True when `pid` exited within `timeout` seconds; does not reap it."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(pidfd)


def _read_head(path: str, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(max_bytes)
    except FileNotFoundError:
        return b""


def _parse_results(raw: bytes) -> tuple[dict | None, list[str]]:
    """(kernel layers line, records): complete JSON lines up to the first malformed one (a kill
    may cut the last); the layers line is None when the runner never finished its set-up."""
    lines = raw.split(b"\n")[:-1]
    try:
        layers = json.loads(lines[0]) if lines else None
    except ValueError:
        layers = None
    if not isinstance(layers, dict):
        return None, []
    records = []
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not isinstance(record, str):
            break
        records.append(record)
    return layers, records


def _run_sandboxed(job: dict, n_records: int,
                   limits: SandboxLimits) -> tuple[dict, list[str]]:
    """Run one job in a fresh sandbox: (active kernel layers, exactly `n_records` records)."""
    wall = limits.wall_for(n_records)
    job = {**job, "call_seconds": limits.call_seconds, "cpu_seconds": limits.cpu_for(n_records),
           "memory_bytes": limits.memory_bytes,
           "max_output_bytes": limits.max_output_bytes, "max_processes": limits.max_processes,
           "max_repr_chars": MAX_REPR_CHARS,
           "extra_sys_path": sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})}
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="corl_sandbox_"))
    try:
        with open(os.path.join(workdir, "job.pkl"), "wb") as file:
            pickle.dump(job, file)
        stderr_path = os.path.join(workdir, "stderr.txt")
        with open(stderr_path, "wb") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-S", "-P", "-B", str(_RUNNER)], cwd=workdir,
                env=_child_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=stderr, start_new_session=True)
        try:
            timed_out = not _wait_for_exit(child.pid, wall)
        finally:
            try:  # the child is not reaped yet, so its pid (= process group id) is still ours
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.stdin.close()
            child.wait()
        layers, records = _parse_results(_read_head(os.path.join(workdir, _RESULTS_FILE),
                                                    limits.max_output_bytes))
        if layers is None:
            detail = _read_head(stderr_path, _STDERR_SHOWN_BYTES).decode("utf-8", "replace")
            raise SandboxError(
                f"the sandbox runner did not start (exit status {child.returncode}, "
                f"timed out: {timed_out}); is memory_bytes={limits.memory_bytes} enough for "
                f"{sys.executable}? stderr:\n{detail}")
        records = records[:n_records]
        killed = timed_out or child.returncode in (-signal.SIGKILL, -signal.SIGXCPU)
        missing = "<TIMEOUT>" if killed else "<ERR:SandboxExit>"
        return layers, records + [missing] * (n_records - len(records))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_outputs(code: str, func_name: str, call_inputs: Sequence[tuple], *,
                limits: SandboxLimits = VOTE_LIMITS) -> list[str]:
    """`repr` of `func_name(*args)` for each input, or a marker: `<NOFUNC>`, `<TIMEOUT>`,
    `<ERR:SystemExit:code>`, `<ERR:ExcName>`.

    As in the reference, `"from typing import *\\n" + code` is executed afresh (new globals) for
    every input under the per-call timer; all inputs share one sandbox process.
    """
    _require_str(code, "code")
    _require_str(func_name, "func_name")
    call_inputs = list(call_inputs)
    for args in call_inputs:
        if not isinstance(args, tuple):
            raise TypeError(f"call_inputs must hold argument tuples (as extract_calls returns), "
                            f"got {type(args).__name__}")
    if not call_inputs:
        return []
    job = {"mode": "calls", "code": code, "func_name": func_name, "inputs": call_inputs,
           "preload": []}
    return _run_sandboxed(job, len(call_inputs), limits)[1]


def voting_answer(text: str, test_code: str, *,
                  limits: SandboxLimits = VOTE_LIMITS) -> str | None:
    """The completion's vote key: `repr(tuple(outputs))` on the test's call inputs; None when there
    is no code, no call input, or every output is a marker (starts with `<`)."""
    code = extract_code(text)
    func_name, call_inputs = extract_calls(test_code)
    if code is None or func_name is None or not call_inputs:
        return None
    outputs = run_outputs(code, func_name, call_inputs, limits=limits)
    if all(output.startswith("<") for output in outputs):
        return None
    return repr(tuple(outputs))


def passes_tests(text: str, test_code: str, *, limits: SandboxLimits = TEST_LIMITS) -> bool:
    """GT grading: exec code + test_code, call every callable named `test*`; True only if there
    is at least one and none raises (any BaseException or timeout is a failure)."""
    return code_passes_tests(extract_code(text), test_code, limits=limits)


def code_passes_tests(code: str | None, test_code: str, *, limits: SandboxLimits = TEST_LIMITS) -> bool:
    """`passes_tests` on program text itself (no fence extraction), e.g. a HumanEval prompt + its completion."""
    _require_str(test_code, "test_code")
    if code is None or not test_code:
        return False
    # CoMAS tests use pytest.raises; importing pytest (~0.3 s) before the timer starts keeps it
    # from eating the 4 s budget (the reference paid it once per trainer process).
    job = {"mode": "tests", "code": code, "test_code": test_code,
           "preload": ["pytest"] if "pytest" in test_code else []}
    return _run_sandboxed(job, 1, limits)[1] == ["<PASS>"]


def sandbox_confinement(limits: SandboxLimits = VOTE_LIMITS) -> dict:
    """The kernel layers a sandbox gets on this machine, e.g. {"landlock_abi": 7, "seccomp": True}
    (0 / False where the kernel lacks them and only the audit hook and rlimits remain)."""
    job = {"mode": "calls", "code": "", "func_name": "", "inputs": [], "preload": []}
    return _run_sandboxed(job, 0, limits)[0]


def _map_concurrently(grade: Callable, texts: Sequence[str], test_codes: Sequence[str],
                      limits: SandboxLimits, max_workers: int) -> list:
    if len(texts) != len(test_codes):
        raise ValueError(f"texts and test_codes must pair up one to one, got {len(texts)} texts "
                         f"and {len(test_codes)} test codes (repeat a prompt's test code for "
                         f"each of its completions)")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(lambda pair: grade(*pair, limits=limits), zip(texts, test_codes)))


def voting_answer_batch(texts: Sequence[str], test_codes: Sequence[str], *,
                        limits: SandboxLimits = VOTE_LIMITS,
                        max_workers: int = 2) -> list[str | None]:
    """`voting_answer` for many completions, `max_workers` sandboxes at a time."""
    return _map_concurrently(voting_answer, texts, test_codes, limits, max_workers)


def passes_tests_batch(texts: Sequence[str], test_codes: Sequence[str], *,
                       limits: SandboxLimits = TEST_LIMITS, max_workers: int = 2) -> list[bool]:
    """`passes_tests` for many completions, `max_workers` sandboxes at a time."""
    return _map_concurrently(passes_tests, texts, test_codes, limits, max_workers)
