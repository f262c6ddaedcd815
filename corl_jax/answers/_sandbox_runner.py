"""Child side of the code sandbox (see `corl_jax.answers.code`); run as a script, never imported
by the trainer.

Started by the parent in a fresh working directory holding `job.pkl` (written by the parent, so
trusted), with a record key waiting on stdin and descriptors of two unlinked files, for set-up and
results, at `job["setup_fd"]` and `job["results_fd"]`. Before any untrusted code runs, in this
order: read the key (the pipe is then empty); read the job; confine the process in the kernel where
the kernel allows it (without Landlock, a new PID namespace with its own /proc; no_new_privs;
Landlock: file-system writes only beneath the working directory, no reads of other processes' /proc
entries, no TCP, no signals to processes outside the sandbox; seccomp: no fork/exec/socket/ptrace,
no mount changes, no kill of other pids); start a watchdog that exits when the parent goes away
(stdin reaches EOF); lower the resource limits; install an audit hook that refuses the same escapes
at the Python level (and works on any kernel); hide this module from `sys.modules`. Then the
completion's code is executed, mirroring the reference's in-process `run_outputs` / `passes_tests`
(per-call SIGALRM timer, stdout swallowed, `sys.argv` neutralised).

Records: one line each, `<seq> <base64 of the UTF-8 text> <keyed BLAKE2b tag of the rest>`, appended
as soon as known (a kill keeps those already written); record 0, alone in the set-up file whose
descriptor is closed before the completion runs, is a JSON object saying which kernel layers are
active. What reports a record after the completion has run uses only names bound before it ran: this
module's globals (gone from `sys.modules`), a private copy of the builtins, and module functions
bound at import, so patching `builtins`, `os`, `json`, `hashlib` or `__main__` does not change what
is reported.
"""

import binascii
import builtins
import ctypes
import hashlib
import io
import itertools
import json
import os
import pickle
import resource
import signal
import stat
import sys
import threading
import types
import typing  # noqa: F401  pre-imported: the completion starts with `from typing import *`

# Private builtins: functions defined below look names up here, not in the `builtins` module the
# completion can patch; the completion itself gets the real module (as in the reference).
__builtins__ = dict(vars(builtins))
_write, _setitimer, _set_signal = os.write, signal.setitimer, signal.signal
_blake2b, _sha256, _encode = hashlib.blake2b, hashlib.sha256, str.encode
_base64 = binascii.b2a_base64
_read, _exit, _SIGALRM, _ITIMER_REAL = os.read, os._exit, signal.SIGALRM, signal.ITIMER_REAL
KEY_BYTES = 32  # same in corl_jax.answers.code

_MAX_OPEN_FILES = 64
_MAX_WRITE_OPENS = 256  # bounds the disk a completion can fill: this many files of RLIMIT_FSIZE
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DENIED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "pty.spawn",
    "subprocess.Popen", "socket.__new__", "resource.setrlimit", "resource.prlimit",
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
    "ctypes.string_at", "ctypes.wstring_at", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "os.killpg", "os.symlink", "os.link", "os.chown", "os.setxattr",
    "os.removexattr",
})
# Modules that reach around the audit hook: fork_exec is not audited, subinterpreters and the
# CPython test modules run code without this interpreter's hooks.
_DENIED_IMPORT_PREFIXES = ("_posixsubprocess", "_xxsubinterpreters", "_xxinterpchannels", "_test")
# event -> (indices of path arguments, index of their dir_fd argument or None)
_PATH_EVENTS = {
    "os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2),
    "os.chmod": ((0,), 2), "os.utime": ((0,), 3), "os.truncate": ((0,), None),
    "os.rename": ((0, 1), 2), "shutil.rmtree": ((0,), None),
}


class CallTimeout(Exception):
    """Raised by the per-call timer; an `Exception`, as in the reference, so code may catch it."""


class _Discard(io.TextIOBase):
    """Swallows the completion's prints without keeping them (the reference used a StringIO)."""

    def write(self, text):
        return len(text)


def marker(exc: BaseException) -> str:
    if isinstance(exc, CallTimeout):
        return "<TIMEOUT>"
    if isinstance(exc, SystemExit):
        return f"<ERR:SystemExit:{exc.code}>"
    return f"<ERR:{type(exc).__name__}>"


def compact(text: str, max_chars: int) -> str:
    """Long reprs keep their head and a digest: equal outputs stay equal, records stay small."""
    if len(text) <= max_chars:
        return text
    digest = _sha256(_encode(text, "utf-8", "surrogatepass")).hexdigest()
    return f"{text[:max_chars // 4]}...<sha256:{digest} chars:{len(text)}>"


def limited(seconds: float, action):
    """`action()` under a per-call SIGALRM timer with stdout swallowed, like the reference's
    `_time_limit`."""

    def on_alarm(signum, frame):
        raise CallTimeout()

    previous = _set_signal(_SIGALRM, on_alarm)
    stdout, sys.stdout = sys.stdout, _Discard()
    _setitimer(_ITIMER_REAL, seconds)
    try:
        return action()
    finally:
        _setitimer(_ITIMER_REAL, 0)
        _set_signal(_SIGALRM, previous)
        sys.stdout = stdout


def read_key() -> bytes:
    """The parent's record key, the first `KEY_BYTES` on stdin (read before any untrusted code)."""
    key = b""
    while len(key) < KEY_BYTES:
        chunk = os.read(0, KEY_BYTES - len(key))
        if not chunk:
            os._exit(70)  # the parent is gone
        key += chunk
    return key


def recorder(fd: int, key: bytes, first_seq: int):
    """`record(text)`: append one line `<seq> <base64> <tag>` to `fd`; the tag is a keyed BLAKE2b
    of `<seq> <base64>`, so a line the completion writes itself does not verify."""
    next_seq = itertools.count(first_seq).__next__

    def record(text: str):
        payload = _base64(_encode(text, "utf-8", "surrogatepass"), newline=False)
        body = b"%d %s" % (next_seq(), payload)
        tag = _blake2b(body, key=key, digest_size=16).hexdigest()
        _write(fd, b"%s %s\n" % (body, _encode(tag)))

    return record


def exit_when_parent_gone():
    """The parent holds our stdin open until it has collected us; EOF means it died."""
    try:
        while _read(0, 4096):
            pass
    except OSError:
        pass
    _exit(70)


# ------------------------------------------------------------------------------ kernel layers
_PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS, _SECCOMP_MODE_FILTER = 22, 38, 2
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # all arches
_LANDLOCK_RULE_PATH_BENEATH, _LANDLOCK_CREATE_RULESET_VERSION = 1, 1
_LANDLOCK_READ_RIGHTS = (1 << 2) | (1 << 3)  # READ_FILE, READ_DIR
# rights a rule on a non-directory may carry: EXECUTE, WRITE_FILE, READ_FILE, TRUNCATE, IOCTL_DEV
_LANDLOCK_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
_CLONE_THREAD = 0x10000
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
# machine -> (AUDIT_ARCH, clone, clone3, kill, tgkill, refused syscalls: fork, vfork, execve,
# execveat, ptrace, process_vm_readv/writev, tkill, pidfd_send_signal, pidfd_getfd, socket,
# io_uring_setup, unshare, setns, mount, umount2, pivot_root, chroot, open_by_handle_at; then the
# new mount API, numbered alike on both: open_tree, move_mount, fsopen, fsmount, fspick,
# mount_setattr). No mount changes keeps the PID namespace's own /proc in place.
_NEW_MOUNT_API = (428, 429, 430, 432, 433, 442)
_SECCOMP_TABLES = {
    "x86_64": (0xC000003E, 56, 435, 62, 234,
               (57, 58, 59, 322, 101, 310, 311, 200, 424, 438, 41, 425, 272, 308, 165, 166, 155,
                161, 304) + _NEW_MOUNT_API),
    "aarch64": (0xC00000B7, 220, 435, 129, 131,
                (221, 281, 117, 270, 271, 130, 424, 438, 198, 425, 97, 268, 40, 39, 41, 51, 265)
                + _NEW_MOUNT_API),
}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def _checked(result: int) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def landlock_write_rights(abi: int) -> int:
    """WRITE_FILE, REMOVE_DIR/FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM (ABI 1), REFER (ABI 2),
    TRUNCATE (ABI 3)."""
    rights = (1 << 1) | sum(1 << bit for bit in range(4, 13))
    return rights | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)


def landlock_abi(libc) -> int:
    """The kernel's Landlock ABI version; 0 or less where Landlock is missing or disabled."""
    return libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_long(0),
                        ctypes.c_long(_LANDLOCK_CREATE_RULESET_VERSION))


def readable_roots(own_pid: int) -> list[str]:
    """Every entry of / but /proc, and of /proc every entry but other processes' directories."""
    roots = [os.path.join("/", name) for name in os.listdir("/") if name != "proc"]
    return roots + [os.path.join("/proc", name) for name in os.listdir("/proc")
                    if not name.isdigit() or int(name) == own_pid]


def add_landlock_rule(libc, ruleset: int, path: str, rights: int):
    """Allow `rights` beneath `path` (file rights only on a file); skipped where it cannot be
    opened or the kernel refuses a rule there (the access then stays denied)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _LANDLOCK_FILE_RIGHTS
        beneath = _PathBeneathAttr(rights, fd)
        _checked(libc.syscall(ctypes.c_long(_LANDLOCK_ADD_RULE), ctypes.c_long(ruleset),
                              ctypes.c_long(_LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(beneath),
                              ctypes.c_long(0)))
    except OSError:
        pass
    finally:
        os.close(fd)


def restrict_landlock(libc, workdir: str) -> int:
    """Writes only beneath `workdir`; reads anywhere but other processes' /proc entries (and the
    listings of / and /proc); no TCP (ABI 4); no signals or abstract unix sockets to processes
    outside the sandbox (ABI 6). Returns the ABI used, 0 where Landlock is missing."""
    abi = landlock_abi(libc)
    if abi < 1:
        return 0
    write, read = landlock_write_rights(abi), _LANDLOCK_READ_RIGHTS
    attr = _RulesetAttr(write | read, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _checked(libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.byref(attr),
                                    ctypes.c_long(size), ctypes.c_long(0)))
    try:
        add_landlock_rule(libc, ruleset, workdir, write | read)
        for path in readable_roots(os.getpid()):
            add_landlock_rule(libc, ruleset, path, read)
        _checked(libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_long(ruleset),
                              ctypes.c_long(0)))
    finally:
        os.close(ruleset)
    return abi


def seccomp_program(machine: str, own_pid: int) -> list[tuple[int, int, int, int]] | None:
    """Classic BPF (code, jt, jf, k): refuse process creation, exec, sockets, ptrace and signals
    to other pids with EPERM; threads (clone with CLONE_THREAD) stay allowed; clone3 answers
    ENOSYS so that libc falls back to clone, whose flags can be inspected. None: unknown machine."""
    if machine not in _SECCOMP_TABLES:
        return None
    arch, clone, clone3, kill, tgkill, refused = _SECCOMP_TABLES[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm),  # foreign ABI (i386)
               (load, 0, 0, 0), (jge, "deny", 0, 0x40000000)]  # x32 syscalls
    program += [(jeq, "deny", 0, number) for number in refused]
    program += [(jeq, "enosys", 0, clone3), (jeq, "clone", 0, clone), (jeq, "pid", 0, kill),
                (jeq, "pid", 0, tgkill), (ret, 0, 0, allow)]
    labels = {}
    for label, block in (("clone", [(load, 0, 0, 16), (jset, "allow", "deny", _CLONE_THREAD)]),
                         ("pid", [(load, 0, 0, 16), (jeq, "allow", "deny", own_pid)]),
                         ("allow", [(ret, 0, 0, allow)]), ("deny", [(ret, 0, 0, eperm)]),
                         ("enosys", [(ret, 0, 0, enosys)])):
        labels[label] = len(program)
        program += block

    def offset(target, index):  # BPF jumps are relative and forward only
        return labels[target] - index - 1 if isinstance(target, str) else target

    return [(code, offset(jt, i), offset(jf, i), k) for i, (code, jt, jf, k) in enumerate(program)]


def install_seccomp(libc) -> bool:
    program = seccomp_program(os.uname().machine, os.getpid())
    if program is None:
        return False
    filters = (_SockFilter * len(program))(*(_SockFilter(*instruction) for instruction in program))
    fprog = _SockFprog(len(program), filters)
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        if ctypes.get_errno() == 22:  # EINVAL: kernel built without seccomp filters
            return False
        _checked(-1)
    return True


def kill_quietly(pidfd: int):
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass


def enter_pid_namespace(libc, new_user_namespace: bool) -> bool:
    """Go on as pid 1 of a new PID namespace with its own /proc, where no other process exists;
    the calling process stays behind only to wait for it, kill it on SIGTERM, and exit alike (a
    SIGKILL or SIGXCPU death as a SIGKILL). Unprivileged users need a user namespace too. False
    where the kernel or the user's rights do not allow it: the calling process goes on, its pid
    and /proc unchanged."""
    flags = _CLONE_NEWPID | _CLONE_NEWNS | (_CLONE_NEWUSER if new_user_namespace else 0)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        return False
    # private first, so that the /proc mount below stays in this namespace
    if libc.mount(None, b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) != 0:
        return False
    ready_read, ready_write = os.pipe()
    pid = os.fork()  # no threads exist yet
    if pid == 0:
        os.close(ready_read)
        if libc.mount(b"proc", b"/proc", b"proc",
                      ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), None) != 0:
            os._exit(0)  # a /proc showing other pids under our own: the caller goes on instead
        os.write(ready_write, b"1")
        os.close(ready_write)
        return True
    os.close(ready_write)
    # The parent's SIGTERM (its wall limit): kill pid 1 here and reap it, leaving no orphan for
    # init (or a trainer running as a container's pid 1) to reap. A pidfd cannot hit a reused pid.
    child = os.pidfd_open(pid)
    signal.signal(signal.SIGTERM, lambda signum, frame: kill_quietly(child))
    ready = os.read(ready_read, 1)
    os.close(ready_read)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os.close(child)
    if not ready and code == 0:  # it could not mount /proc
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return False
    if code in (-signal.SIGKILL, -signal.SIGXCPU):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code if code >= 0 else 128 - code)


def confine_kernel(workdir: str) -> dict:
    """Kernel-enforced layers for this process and its future threads; what is active."""
    libc = _libc()
    # Landlock keeps other processes' /proc entries unreadable; where it is missing, a PID
    # namespace does (at the price of a fork and a namespace teardown, ~5 ms per sandbox).
    pid_namespace = landlock_abi(libc) < 1 and enter_pid_namespace(
        libc, new_user_namespace=os.geteuid() != 0)
    _checked(libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                        ctypes.c_ulong(0), ctypes.c_ulong(0)))
    return {"pid_namespace": pid_namespace, "landlock_abi": restrict_landlock(libc, workdir),
            "seccomp": install_seccomp(libc)}


# ------------------------------------------------------------------------------ Python layers
def set_limits(job):
    # CPU: SIGXCPU at the soft limit (terminates), SIGKILL one second later if it is handled.
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_seconds"], job["cpu_seconds"] + 1))
    limits = {  # hard = soft: the completion cannot raise them again
        resource.RLIMIT_AS: job["memory_bytes"],
        resource.RLIMIT_FSIZE: job["max_output_bytes"],
        resource.RLIMIT_NOFILE: _MAX_OPEN_FILES,
        resource.RLIMIT_CORE: 0,
        # Binds only non-root users (and counts all their processes); as root, seccomp, the audit
        # hook and the parent's kill of the whole process group contain forks.
        resource.RLIMIT_NPROC: job["max_processes"],
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def install_guard(workdir: str):
    own_pid = os.getpid()
    proc_prefix = "/proc/"
    writes = [0]

    def resolve(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):  # -1: none given
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.realpath(path)

    def inside(resolved):
        return resolved == workdir or resolved.startswith(workdir + os.sep)

    def foreign_proc(resolved):
        if not resolved.startswith(proc_prefix):
            return False
        entry = resolved[len(proc_prefix):].split(os.sep, 1)[0]
        return entry.isdigit() and int(entry) != own_pid

    def guard(event, args):
        if event in _DENIED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            if args[0].startswith(_DENIED_IMPORT_PREFIXES):
                raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        elif event == "ctypes.dlopen":
            if args[0] is not None:
                raise PermissionError("sandbox: loading native libraries is not allowed")
        elif event == "os.kill":
            if args[0] != own_pid:  # as the seccomp filter: no groups, no other pids
                raise PermissionError("sandbox: signalling other processes is not allowed")
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            text = os.fsdecode(path)
            resolved = resolve(path)
            if foreign_proc(resolved):
                raise PermissionError("sandbox: other processes' /proc entries are off limits")
            # os.open (mode None) may carry a dir_fd the event does not show. Directory fds exist
            # only inside the working directory, and relative paths may not climb out of one.
            if mode is None and not os.path.isabs(text) and os.pardir in text.split(os.sep):
                raise PermissionError(f"sandbox: os.open of {text!r}: '..' in a relative path")
            if mode is None and not inside(resolved) and os.path.isdir(resolved):
                raise PermissionError(f"sandbox: opening the directory {text!r} is not allowed")
            if flags & _WRITE_FLAGS:
                if not inside(resolved) or (mode is None and not os.path.isabs(text)):
                    raise PermissionError(f"sandbox: writing {text!r} is not allowed")
                writes[0] += 1
                if writes[0] > _MAX_WRITE_OPENS:
                    raise PermissionError("sandbox: too many files opened for writing")
        elif event in _PATH_EVENTS:
            path_indices, dir_fd_index = _PATH_EVENTS[event]
            dir_fd = args[dir_fd_index] if dir_fd_index is not None else None
            for index in path_indices:
                if not isinstance(args[index], int) and not inside(resolve(args[index], dir_fd)):
                    raise PermissionError(f"sandbox: {event} outside the working directory")

    sys.addaudithook(guard)


def run_calls(job, record):
    """`run_outputs` of the reference: exec the code afresh for every input, call, repr."""

    def call(args):
        namespace = {"__builtins__": builtins}
        exec("from typing import *\n" + job["code"], namespace)
        func = namespace.get(job["func_name"])
        return "<NOFUNC>" if func is None else compact(repr(func(*args)), job["max_repr_chars"])

    for args in job["inputs"]:
        sys.argv = [job["func_name"]]
        try:
            outcome = limited(job["call_seconds"], lambda: call(args))
        except BaseException as exc:  # noqa: B036  untrusted code may raise anything
            outcome = marker(exc)
        record(outcome)


def run_tests(job, record):
    """`passes_tests` of the reference: exec code + tests, call every callable named test*."""

    def run():
        namespace = {"__builtins__": builtins}
        exec("from typing import *\n" + job["code"] + "\n" + job["test_code"], namespace)
        tests = [value for name, value in namespace.items()
                 if name.startswith("test") and callable(value)]
        for test in tests:
            test()
        return "<PASS>" if tests else "<NOTESTS>"

    sys.argv = ["pytest"]
    try:
        outcome = limited(job["call_seconds"], run)
    except BaseException as exc:  # noqa: B036
        outcome = marker(exc)
    record(outcome)


def stub_posixsubprocess():
    """`_posixsubprocess.fork_exec` raises no audit event: a stand-in keeps `import subprocess`
    (pytest needs it) working while the real module is never loaded (its import is refused)."""
    stub = types.ModuleType("_posixsubprocess")

    def fork_exec(*args, **kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    stub.fork_exec = fork_exec
    sys.modules["_posixsubprocess"] = stub


def main():
    key = read_key()
    with open("job.pkl", "rb") as file:
        job = pickle.load(file)
    workdir = os.path.realpath(os.getcwd())
    layers = confine_kernel(workdir)
    threading.Thread(target=exit_when_parent_gone, daemon=True).start()
    set_limits(job)  # after the thread: RLIMIT_NPROC counts threads for non-root users
    sys.path.extend(job["extra_sys_path"])
    stub_posixsubprocess()
    for module in job["preload"]:  # trusted imports (pytest) stay outside the per-call timer
        __import__(module)
    install_guard(workdir)
    sys.modules["__main__"] = types.ModuleType("__main__")  # `import __main__` is not this module
    # record 0, the parent's sign that set-up is complete, goes where the completion cannot reach
    recorder(job["setup_fd"], key, 0)(json.dumps(layers))
    os.close(job["setup_fd"])
    record = recorder(job["results_fd"], key, 1)
    del key
    {"calls": run_calls, "tests": run_tests}[job["mode"]](job, record)
    _exit(0)  # do not wait for threads the completion may have left running


if __name__ == "__main__":
    main()
