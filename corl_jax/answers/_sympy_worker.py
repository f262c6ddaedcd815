"""`simplify(parse_expr(expr)) == 0` in persistent worker processes that are killed when they take too long.

sympy can run for hours (or exhaust memory) on short hostile inputs, and its `parse_expr` evaluates Python.
`SympyPool` keeps up to N worker processes and hands each one expression at a time over a pipe, so that a
batch of expressions is checked in parallel; each expression gets at most `timeout_s` of wall-clock time
from when it is sent. On timeout, or if a worker dies, that worker is killed, the expression's answer is
False, and a fresh worker takes the next expression. A worker caps its address space and, per request, its
CPU time (so an orphaned worker cannot spin forever), ignores Ctrl-C, and keeps its protocol off
stdin/stdout.

This file is also the worker's entry point: it is run as a script (`python -P _sympy_worker.py`, so that
this package directory, which holds a `math.py`, never shadows the standard library).
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

MEMORY_LIMIT_BYTES = 2 << 30
STARTUP_TIMEOUT_S = 120.0

# `(a)-(b)` with canonical decimal integer literals (no leading zeros; short enough for `int`).
_INTEGER_DIFFERENCE = re.compile(r"\((-?(?:0|[1-9][0-9]{0,99}))\)-\((-?(?:0|[1-9][0-9]{0,99}))\)")


def integer_difference_is_zero(expr: str) -> bool | None:
    """The worker's answer for `(a)-(b)` with integer literals a, b, without sympy; None for other input.

    `parse_expr` turns the literals into exact `Integer`s, so the difference is the `Integer` a - b, which
    `simplify` returns as it is: it equals 0 iff a == b.
    """
    match = _INTEGER_DIFFERENCE.fullmatch(expr)
    if match is None:
        return None
    return int(match.group(1)) == int(match.group(2))


class SympyWorker:
    """Client of one worker process (not thread-safe: `SympyPool` serialises its use)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop the handle without touching the process (a forked child must not share its parent's)."""
        self._proc: subprocess.Popen | None = None
        self._pending = b""

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None before the first request or after a kill)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process (without waiting for it: see `wait_ready`)."""
        self.kill()
        command = [sys.executable, "-P", os.path.abspath(__file__)]
        try:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
        except OSError as error:
            raise RuntimeError(f"cannot start the sympy worker {command}: {error}") from error

    def wait_ready(self) -> None:
        """Block until the spawned process has imported sympy; a clear error if it cannot."""
        hello = self._read_line(STARTUP_TIMEOUT_S)
        if hello != b"ready":
            self.kill()
            detail = hello.decode(errors="replace") if hello else "no reply"
            raise RuntimeError(
                f"the sympy worker ({sys.executable} -P {__file__}) did not start: {detail}. "
                "Check that sympy is importable by this interpreter (pip install sympy)."
            )

    def send(self, expr: str, timeout_s: float) -> bool:
        """Send one request; False (and the worker killed) if it died since its last reply."""
        request = json.dumps({"expr": expr, "cpu_s": 2 * math.ceil(timeout_s) + 2}).encode() + b"\n"
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
        except OSError:
            self.kill()
            return False
        return True

    def fileno(self) -> int:
        return self._proc.stdout.fileno()

    def read_reply(self) -> bool | None:
        """After `select` found the worker readable: its answer, None if the line is not complete yet.

        A worker that closed its output (died) is killed and answers False.
        """
        chunk = os.read(self.fileno(), 4096)
        if not chunk:
            self.kill()
            return False
        self._pending += chunk
        if b"\n" not in self._pending:
            return None
        line, self._pending = self._pending.split(b"\n", 1)
        return line == b"1"

    def _read_line(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        fd = self.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def kill(self) -> None:
        proc, self._proc, self._pending = self._proc, None, b""
        if proc is None:
            return
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


class SympyPool:
    """Up to N workers checking a batch of expressions in parallel; thread-safe (batches are serialised)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop every handle without touching the processes (after a fork, in the child)."""
        self._workers: list[SympyWorker] = []
        self._lock = threading.Lock()

    @property
    def pids(self) -> list[int | None]:
        return [worker.pid for worker in self._workers]

    def are_zero(self, exprs: list[str], timeout_s: float, n_workers: int) -> list[bool]:
        """`simplify(expr) == 0` for each expression (`^` is power), each bounded by `timeout_s` seconds."""
        if not timeout_s > 0:
            raise ValueError(f"the sympy timeout must be a positive number of seconds, got {timeout_s!r}")
        if not (isinstance(n_workers, int) and n_workers >= 1):
            raise ValueError(f"the number of sympy workers must be a positive int, got {n_workers!r}")
        results = [False] * len(exprs)
        queue = collections.deque(enumerate(exprs))
        with self._lock:
            self._workers += [SympyWorker() for _ in range(n_workers - len(self._workers))]
            workers = self._workers[: min(n_workers, len(exprs))]
            idle = [worker for worker in workers if not worker.running]
            for worker in idle:  # started together: each imports sympy (seconds) in parallel
                worker.spawn()
            for worker in idle:
                worker.wait_ready()
            busy: dict[SympyWorker, tuple[int, float]] = {}  # worker -> (expression index, deadline)
            while queue or busy:
                for worker in workers:
                    if worker in busy or not queue:
                        continue
                    if not worker.running:  # killed after a timeout earlier in this batch
                        worker.spawn()
                        worker.wait_ready()
                    index, expr = queue.popleft()
                    if worker.send(expr, timeout_s):
                        busy[worker] = (index, time.monotonic() + timeout_s)
                if not busy:
                    continue
                wait_s = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                readable = select.select(list(busy), [], [], wait_s)[0]
                for worker in list(busy):
                    index, deadline = busy[worker]
                    if worker in readable:
                        answer = worker.read_reply()
                        if answer is not None:
                            results[index] = answer
                            del busy[worker]
                    elif time.monotonic() >= deadline:
                        worker.kill()
                        del busy[worker]
        return results

    def close(self) -> None:
        """Stop every worker (a later batch starts new ones)."""
        with self._lock:
            for worker in self._workers:
                worker.kill()


# Where `nonzero_at_a_point` evaluates: positive reals, where the principal branches of roots and powers
# agree with the identities that any rewriting could use.
_POINT = ("7/3", "11/5")


def nonzero_at_a_point(difference) -> bool:
    """True when the sympy expression `difference` is exact (integers, rationals, symbols, pi, E, I, `+ * ^`
    only: no Float, no function) and takes a nonzero value at the point (x, y) = (7/3, 11/5) of its (at most
    two) symbols, evaluated to 30 significant digits with the accuracy guaranteed (evalf `strict`).

    Such an expression is not identically zero, so `simplify`, which only rewrites an expression into an
    equal one, cannot return 0: the worker answers False without running it. Anything else (a zero or
    undefined value, an inexact or unusual expression) is left to `simplify`.
    """
    import sympy
    from sympy.core.numbers import Exp1, ImaginaryUnit, Pi

    exact = (sympy.Add, sympy.Mul, sympy.Pow, sympy.Symbol, sympy.Rational, Pi, Exp1, ImaginaryUnit)

    def is_exact(expr) -> bool:
        return all(isinstance(node, exact) for node in sympy.preorder_traversal(expr))

    symbols = sorted(difference.free_symbols, key=str)
    if len(symbols) > len(_POINT) or not is_exact(difference):
        return False
    value = difference.xreplace({symbol: sympy.Rational(p) for symbol, p in zip(symbols, _POINT)})
    if not is_exact(value):  # e.g. a division by zero at the point
        return False
    try:
        number = value.evalf(30, strict=True)
    except Exception:  # PrecisionExhausted: too close to 0 to tell
        return False
    return number.is_zero is False and number.is_finite is True


def simplifies_to_zero(difference) -> bool:
    """The reference's test `simplify(difference) == 0` on a parsed expression, skipped where it must fail."""
    import sympy

    return not nonzero_at_a_point(difference) and bool(sympy.simplify(difference) == 0)


def _limit_cpu_seconds(extra_s: int) -> None:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + extra_s
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _serve() -> None:
    """Worker main loop: one JSON request per line in, `1`/`0` per line out."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        from sympy.parsing import sympy_parser
    except Exception as error:  # report instead of dying silently
        replies.write(b"error " + repr(error).encode(errors="replace").replace(b"\n", b" ") + b"\n")
        return
    transformations = sympy_parser.standard_transformations + (
        sympy_parser.implicit_multiplication_application,
    )
    replies.write(b"ready\n")
    for line in requests:
        request = json.loads(line)
        _limit_cpu_seconds(request["cpu_s"])
        try:
            difference = sympy_parser.parse_expr(
                request["expr"].replace("^", "**"), transformations=transformations
            )
            is_zero = simplifies_to_zero(difference)
        except Exception:  # the reference counts every failure as "not equal"
            is_zero = False
        replies.write(b"1\n" if is_zero else b"0\n")


_POOL = SympyPool()
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.forget)


def are_zero(exprs: list[str], timeout_s: float, n_workers: int) -> list[bool]:
    """`SympyPool.are_zero` on the process-wide pool."""
    return _POOL.are_zero(exprs, timeout_s, n_workers)


def worker_pids() -> list[int | None]:
    """Process ids of the process-wide pool's workers (None where one is not running)."""
    return _POOL.pids


if __name__ == "__main__":
    _serve()
