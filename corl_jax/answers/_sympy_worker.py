"""`simplify(parse_expr(expr)) == 0` in a persistent worker process that is killed when it takes too long.

sympy can run for hours (or exhaust memory) on short hostile inputs, and its `parse_expr` evaluates Python.
The parent (`SympyWorker`) sends one expression at a time over a pipe and waits at most `timeout_s`; on
timeout, or if the worker dies, the worker is killed, the answer is False, and the next call starts a
fresh worker. The worker itself caps its address space and, per request, its CPU time (so an orphaned
worker cannot spin forever), ignores Ctrl-C, and keeps its protocol off stdin/stdout.

This file is also the worker's entry point: it is run as a script (`python -P _sympy_worker.py`, so that
this package directory, which holds a `math.py`, never shadows the standard library).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time

MEMORY_LIMIT_BYTES = 2 << 30
STARTUP_TIMEOUT_S = 120.0


class SympyWorker:
    """Client of one worker process; thread-safe (requests are serialised)."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        """Drop the handle without touching the process (a forked child must not share its parent's)."""
        self._proc: subprocess.Popen | None = None
        self._pending = b""
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None before the first request or after a kill)."""
        return self._proc.pid if self._proc is not None else None

    def is_zero(self, expr: str, timeout_s: float) -> bool:
        """True iff sympy simplifies `expr` (with `^` meaning power) to 0 within `timeout_s` seconds."""
        if not timeout_s > 0:
            raise ValueError(f"the sympy timeout must be a positive number of seconds, got {timeout_s!r}")
        request = json.dumps({"expr": expr, "cpu_s": 2 * math.ceil(timeout_s) + 2}).encode() + b"\n"
        with self._lock:
            proc = self._running()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except OSError:  # the worker died since the last request
                self._kill()
                return False
            reply = self._read_line(timeout_s)
            if reply is None:  # timed out or died
                self._kill()
                return False
            return reply == b"1"

    def close(self) -> None:
        """Stop the worker (a later request starts a new one)."""
        with self._lock:
            self._kill()

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        command = [sys.executable, "-P", os.path.abspath(__file__)]
        try:
            self._proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
            )
        except OSError as error:
            raise RuntimeError(f"cannot start the sympy worker {command}: {error}") from error
        hello = self._read_line(STARTUP_TIMEOUT_S)
        if hello != b"ready":
            self._kill()
            detail = hello.decode(errors="replace") if hello else "no reply"
            raise RuntimeError(
                f"the sympy worker ({sys.executable} -P {__file__}) did not start: {detail}. "
                "Check that sympy is importable by this interpreter (pip install sympy)."
            )
        return self._proc

    def _read_line(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
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

    def _kill(self) -> None:
        proc, self._proc, self._pending = self._proc, None, b""
        if proc is None:
            return
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


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
        import sympy
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
            is_zero = bool(sympy.simplify(difference) == 0)
        except Exception:  # the reference counts every failure as "not equal"
            is_zero = False
        replies.write(b"1\n" if is_zero else b"0\n")


_WORKER = SympyWorker()
atexit.register(_WORKER.close)
os.register_at_fork(after_in_child=_WORKER._forget)


def is_zero(expr: str, timeout_s: float) -> bool:
    """`SympyWorker.is_zero` on the process-wide worker."""
    return _WORKER.is_zero(expr, timeout_s)


def worker_pid() -> int | None:
    """Process id of the process-wide worker, if one is running."""
    return _WORKER.pid


if __name__ == "__main__":
    _serve()
