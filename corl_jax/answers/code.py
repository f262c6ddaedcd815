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
  process group is SIGKILLed while the child is still unreaped (no pid reuse race); in a PID
  namespace the child first gets SIGTERM and up to a second, so that its waiting half kills and
  reaps the namespace's pid 1, leaving no orphan to init; the parent waits on a pidfd, so it never
  blocks longer than the wall limit (plus that second); stdout goes to /dev/null, stderr to a
  size-capped file that is read with a bound; the child exits by itself if the parent dies (a
  trainer killed by SIGKILL leaves the working directories of in-flight sandboxes behind);
* kernel confinement where the kernel offers it (`sandbox_confinement()` says what is active): where
  Landlock is missing, a new PID namespace with its own /proc mount (as root, or with a user
  namespace where unprivileged ones are allowed), in which no other process, the trainer included,
  exists; no_new_privs; Landlock (writes only beneath the working directory; reads anywhere except
  other processes' /proc entries, so not the trainer's environ or cmdline by any path, `..` or
  dir_fd, nor the listings of / and /proc; no TCP; from ABI 6 no signals to processes outside the
  sandbox); a seccomp filter (x86_64, aarch64) refusing fork, vfork, non-thread clone, exec, socket,
  ptrace, process_vm_*, io_uring, unshare/setns, mount changes (so the PID namespace's /proc stays
  in place), chroot, open_by_handle_at and kill/tgkill of any pid but its own;
* an audit hook (`sys.addaudithook`) in the child that refuses the same escapes at the Python
  level on any kernel: fork/exec/spawn/subprocess, signals to other processes, sockets, ctypes
  symbol lookups and raw memory access, imports that bypass the hook (`_posixsubprocess`,
  subinterpreters, CPython test modules), writes outside the working directory, and reads of
  other processes' /proc entries. `os.open`'s event does not show its dir_fd, so directory
  descriptors may only be opened inside the working directory and relative `os.open` paths may
  not contain `..`.

Audit hooks are not a security boundary on their own (native code bypasses them, and the child
runs as the trainer's user, root in CI, for which RLIMIT_NPROC does not count); they turn common
escapes into ordinary `<ERR:PermissionError>` markers. The kernel-enforced parts are the process
isolation, the rlimits, the group kill and, where active, Landlock and seccomp. Reading files
other than /proc entries is not restricted (the reference could read them too): keep secrets off
disks readable by the trainer's user.

Records (threat model). The child writes its records to an unlinked temporary file it holds only as
an inherited descriptor (nothing in the working directory; stdout and stderr are never read as
results); the record that says set-up completed goes to a second one, closed before the completion
runs, so that erasing records makes them missing (a failure), never a SandboxError. Each line
carries a sequence number and a keyed BLAKE2b tag; the 32-byte key is a fresh random per run, sent
on stdin and read by the runner before any untrusted code starts, and the parent keeps only lines
that verify, in sequence, up to the first that does not. So a completion cannot forge a record by
printing, writing files or descriptors (it can read its own earlier lines, but not make new ones),
exiting with any status (`os._exit(0)`, `SystemExit` from a test or a `__del__`: a missing record is
a failure), or patching modules, builtins or `__main__` (the runner reports through names bound
before the code ran). Not covered: the completion shares one interpreter with the runner and, in
`passes_tests`, with its tests (as in the reference), so code that walks interpreter frames
(`frame.f_back` raises no audit event) can reach the runner's reporting function, and code can rig
the tests' semantics (results whose `__eq__` is always true, a patched `pytest.raises`, test
functions replaced from a thread). Closing that would need the tests to run in a process the
completion's code never runs in. The vote key (`run_outputs`) is the completion's own output, so it
has nothing to forge.

Differences from the reference, all in cases the reference could not survive or bound:
prints are discarded instead of buffered; the per-call timer also covers `repr(result)`;
BaseExceptions other than SystemExit become `<ERR:Name>` instead of crashing; when the whole child
dies (wall limit, CPU limit, `os._exit`, segfault) the calls not yet recorded get `<TIMEOUT>`
(killed) or `<ERR:SandboxExit>` (exited); a repr longer than `MAX_REPR_CHARS` is shortened to its
head plus a SHA-256 of the whole (equal outputs stay equal, keys stay small).
"""

from __future__ import annotations

import ast
import binascii
import concurrent.futures
import hashlib
import hmac
import json
import math
import os
import pickle
import re
import secrets
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
_KEY_BYTES = 32  # KEY_BYTES in the runner
_START_UP_SECONDS = 2.0  # wall-clock allowance for the interpreter start on top of the calls
_TERM_GRACE_SECONDS = 1.0  # after the wall limit: SIGTERM, then this long before SIGKILL
_LAYERS_BYTES = 4096  # record 0 (the kernel layers) fits
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


def candidate_calls(test_code: str) -> list[tuple]:
    """Argument tuples of the `candidate(...)` calls inside the asserts of HumanEval-style test code
    (`def check(candidate): assert candidate(...) == ...`), in source order, wherever the call sits
    in the assert (`assert abs(candidate(1.33) - 0.33) < 1e-6` counts). Parsed with `ast`; only
    `literal_eval` of literal arguments; calls with keyword, starred or non-literal arguments are
    skipped (HumanEval/32 draws its inputs at random and so yields none)."""
    _require_str(test_code, "test_code")
    try:
        tree = ast.parse(test_code)
    except Exception:  # noqa: BLE001  as extract_calls
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for call in ast.walk(node.test):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "candidate" and not call.keywords):
                try:
                    found.append((call.lineno, call.col_offset,
                                  tuple(ast.literal_eval(arg) for arg in call.args)))
                except Exception:  # noqa: BLE001  not a literal (Starred, Name, Call, ...)
                    pass
    return [args for _, _, args in sorted(found, key=lambda item: item[:2])]


def _syntax_marker(source: str) -> str | None:
    """`<ERR:SyntaxError>` (or its subclass) when `source` cannot even be parsed, which the sandbox
    would also report for every call; None otherwise (then only the sandbox can tell). Parsing runs
    no code; it spares a sandbox start for text that is not Python (random models' output)."""
    try:
        ast.parse(source)
    except SyntaxError as exc:
        return f"<ERR:{type(exc).__name__}>"
    except Exception:  # noqa: BLE001  e.g. MemoryError on pathological nesting: let the sandbox decide
        return None
    return None


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


def _tag(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, key=key, digest_size=16).hexdigest().encode()


def _parse_records(raw: bytes, key: bytes, first_seq: int) -> list[str]:
    """Texts of the runner's lines `<seq> <base64> <tag>`, up to the first line that is cut (a
    kill), out of sequence or not tagged with `key` (so written by the completion)."""
    texts = []
    for seq, line in enumerate(raw.split(b"\n")[:-1], start=first_seq):
        body, _, tag = line.rpartition(b" ")
        number, _, payload = body.partition(b" ")
        if number != b"%d" % seq or not hmac.compare_digest(tag, _tag(key, body)):
            break
        texts.append(binascii.a2b_base64(payload).decode("utf-8", "surrogatepass"))
    return texts


def _read_layers(setup_fd: int, key: bytes) -> dict | None:
    """Record 0, the kernel layers; None when the runner never finished its set-up."""
    texts = _parse_records(os.pread(setup_fd, _LAYERS_BYTES, 0), key, 0)
    return json.loads(texts[0]) if texts else None


def _run_sandboxed(job: dict, n_records: int,
                   limits: SandboxLimits) -> tuple[dict, list[str]]:
    """Run one job in a fresh sandbox: (active kernel layers, exactly `n_records` records)."""
    wall = limits.wall_for(n_records)
    key = secrets.token_bytes(_KEY_BYTES)
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="corl_sandbox_"))
    # Records go to unlinked files that the child holds only as inherited descriptors; the set-up
    # one (record 0) is closed before untrusted code runs, so a completion cannot erase it.
    with tempfile.TemporaryFile() as setup, tempfile.TemporaryFile() as results:
        job = {**job, "setup_fd": setup.fileno(), "results_fd": results.fileno(),
               "call_seconds": limits.call_seconds,
               "cpu_seconds": limits.cpu_for(n_records), "memory_bytes": limits.memory_bytes,
               "max_output_bytes": limits.max_output_bytes,
               "max_processes": limits.max_processes, "max_repr_chars": MAX_REPR_CHARS,
               "extra_sys_path": sorted({sysconfig.get_path("purelib"),
                                         sysconfig.get_path("platlib")})}
        try:
            with open(os.path.join(workdir, "job.pkl"), "wb") as file:
                pickle.dump(job, file)
            stderr_path = os.path.join(workdir, "stderr.txt")
            with open(stderr_path, "wb") as stderr:
                child = subprocess.Popen(
                    [sys.executable, "-S", "-P", "-B", str(_RUNNER)], cwd=workdir,
                    env=_child_env(workdir), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=stderr, start_new_session=True,
                    pass_fds=(setup.fileno(), results.fileno()))
            try:
                try:  # read by the runner before any untrusted code runs
                    child.stdin.write(key)
                    child.stdin.flush()
                except BrokenPipeError:  # the runner died at start: reported below
                    pass
                timed_out = not _wait_for_exit(child.pid, wall)
                if timed_out and (_read_layers(setup.fileno(), key) or {}).get("pid_namespace"):
                    child.terminate()  # its waiting half kills and reaps the namespace's pid 1
                    _wait_for_exit(child.pid, _TERM_GRACE_SECONDS)
            finally:
                try:  # the child is not reaped yet, so its pid (= process group id) is still ours
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    child.stdin.close()
                except BrokenPipeError:
                    pass
                child.wait()
            layers = _read_layers(setup.fileno(), key)
            if layers is None:
                detail = _read_head(stderr_path, _STDERR_SHOWN_BYTES).decode("utf-8", "replace")
                raise SandboxError(
                    f"the sandbox runner did not start (exit status {child.returncode}, "
                    f"timed out: {timed_out}); is memory_bytes={limits.memory_bytes} enough for "
                    f"{sys.executable}? stderr:\n{detail}")
            records = _parse_records(os.pread(results.fileno(), limits.max_output_bytes, 0),
                                     key, 1)[:n_records]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    killed = timed_out or child.returncode in (-signal.SIGKILL, -signal.SIGXCPU)
    missing = "<TIMEOUT>" if killed else "<ERR:SandboxExit>"
    return layers, records + [missing] * (n_records - len(records))


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
    error = _syntax_marker("from typing import *\n" + code)  # the runner's exec'd source
    if error is not None:
        return [error] * len(call_inputs)
    job = {"mode": "calls", "code": code, "func_name": func_name, "inputs": call_inputs,
           "preload": []}
    return _run_sandboxed(job, len(call_inputs), limits)[1]


def voting_answer(text: str, test_code: str, *,
                  limits: SandboxLimits = VOTE_LIMITS) -> str | None:
    """The completion's vote key: `repr(tuple(outputs))` on the test's call inputs; None when there
    is no code, no call input, or every output is a marker (starts with `<`)."""
    return output_key(text, *extract_calls(test_code), limits=limits)


def output_key(text: str, func_name: str | None, call_inputs: Sequence[tuple], *,
               limits: SandboxLimits = VOTE_LIMITS) -> str | None:
    """`voting_answer` with the called name and inputs given (e.g. from `candidate_calls`)."""
    code = extract_code(text)
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
    if _syntax_marker("from typing import *\n" + code + "\n" + test_code) is not None:
        return False
    # CoMAS tests use pytest.raises; importing pytest (~0.3 s) before the timer starts keeps it
    # from eating the 4 s budget (the reference paid it once per trainer process).
    job = {"mode": "tests", "code": code, "test_code": test_code,
           "preload": ["pytest"] if "pytest" in test_code else []}
    return _run_sandboxed(job, 1, limits)[1] == ["<PASS>"]


def sandbox_confinement(limits: SandboxLimits = VOTE_LIMITS) -> dict:
    """The kernel layers a sandbox gets on this machine, e.g. {"pid_namespace": False,
    "landlock_abi": 7, "seccomp": True} (a PID namespace only where Landlock is missing; False /
    0 where the kernel or the user's rights lack them and only the audit hook and rlimits
    remain)."""
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


def passes_tests_batch(texts: Sequence[str], test_codes: Sequence[str], *,
                       limits: SandboxLimits = TEST_LIMITS, max_workers: int = 2) -> list[bool]:
    """`passes_tests` for many completions, `max_workers` sandboxes at a time."""
    return _map_concurrently(passes_tests, texts, test_codes, limits, max_workers)
