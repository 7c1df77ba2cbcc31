"""Make one system call inside another process (its QEMU), through ptrace.

A few kernel objects can only be made by the process they belong to: a
userfaultfd watches the address space of whoever created it. To track which
guest pages QEMU writes (:mod:`forkd.vmm.snapshot.write_tracking`) the daemon has one
of QEMU's threads make that call and then takes the descriptor over with
``pidfd_getfd``; everything else it does on the descriptor from outside.

How: seize one thread, stop it, point its registers at a ``syscall``
instruction already in its code with the call's number and arguments,
single-step over it, read the result and put every register back. The
thread resumes where it was; a system call it was blocked in restarts.

Only a thread other than the process's leader is used: the leader's stops
would be seen by ``waitpid(pid)`` in whoever spawned QEMU (the daemon's
``subprocess.Popen``), which must keep seeing only its exit. x86-64 only;
elsewhere :class:`RemoteSyscallUnsupported` is raised and callers fall back.
All ptrace requests of one call run on one OS thread, as ptrace requires.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import signal
import time
from pathlib import Path

_PTRACE_SINGLESTEP = 9
_PTRACE_GETREGS = 12
_PTRACE_SETREGS = 13
_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000
_SYSCALL_INSN = b"\x0f\x05"
_STOP_WAIT_SECS = 30.0  # a thread in uninterruptible sleep stops when it leaves it
_MAX_SCAN = 4 << 20
_PTRACE_EVENT_STOP = 128

SYS_USERFAULTFD = 323
SYS_CLOSE = 3
_SYS_PIDFD_OPEN = 434
_SYS_PIDFD_GETFD = 438

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.syscall.restype = ctypes.c_long


class RemoteSyscallUnsupported(OSError):
    """This host cannot make calls inside another process (architecture, ptrace)."""


_REG_NAMES = (
    *("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx"),
    *("rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base"),
    *("gs_base", "ds", "es", "fs", "gs"),
)


class _Regs(ctypes.Structure):
    """``struct user_regs_struct`` of x86-64, in the kernel's order."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in _REG_NAMES]


_ARG_REGS = ("rdi", "rsi", "rdx", "r10", "r8", "r9")


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.Structure = 0) -> int:
    arg = ctypes.byref(data) if isinstance(data, ctypes.Structure) else ctypes.c_void_p(data)
    result = _libc.ptrace(request, tid, ctypes.c_void_p(addr), arg)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request}) on thread {tid}: {os.strerror(err)}")
    return int(result)


def _wait_stop(tid: int) -> int:
    deadline = time.monotonic() + _STOP_WAIT_SECS
    while True:
        got, status = os.waitpid(tid, os.WNOHANG | _WALL)
        if got == tid:
            if not os.WIFSTOPPED(status):
                raise ProcessLookupError(f"thread {tid} ended while stopped for a call")
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"thread {tid} did not stop within {_STOP_WAIT_SECS} s")
        time.sleep(0.0005)


def _pick_thread(pid: int) -> int:
    """A thread of ``pid`` other than its leader; QEMU's ``call_rcu`` if it has one."""
    others = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
        tid = int(task.name)
        if tid == pid:
            continue
        try:
            if task.joinpath("comm").read_text().strip() == "call_rcu":
                return tid
        except OSError:
            continue
        others.append(tid)
    if not others:
        raise RemoteSyscallUnsupported(errno.ESRCH, f"process {pid} has no thread but its leader")
    return others[0]


def _syscall_address(pid: int) -> int:
    """The address of a ``syscall`` instruction in ``pid``'s code: its vDSO's (the
    kernel's, two pages), else its C library's. Reads at most _MAX_SCAN bytes of a
    mapping: a hostile QEMU could name a huge one after libc."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        candidates: list[tuple[int, int, int]] = []
        for line in maps:
            parts = line.split()
            if len(parts) < 6 or "x" not in parts[1]:
                continue
            name = parts[5]
            rank = 0 if name == "[vdso]" else 1 if Path(name).name.startswith("libc.so") else -1
            if rank >= 0:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                candidates.append((rank, lo, min(hi, lo + _MAX_SCAN)))
        for _, lo, hi in sorted(candidates):
            at = os.pread(mem.fileno(), hi - lo, lo).find(_SYSCALL_INSN)
            if at >= 0:
                return lo + at
    raise RemoteSyscallUnsupported(errno.ENOEXEC, f"no syscall instruction in process {pid}")


def call(pid: int, number: int, *args: int) -> int:
    """Make system call ``number`` with ``args`` in process ``pid``; its return value.

    Blocking, a few milliseconds: one of ``pid``'s threads is stopped for that
    long. A negative return is the call's ``-errno``, as the kernel gives it.
    """
    if not supported():
        arch = platform.machine()
        raise RemoteSyscallUnsupported(errno.ENOSYS, f"remote calls need x86-64, not {arch}")
    if len(args) > len(_ARG_REGS):
        raise ValueError("a system call takes at most six arguments")
    insn = _syscall_address(pid)
    tid = _pick_thread(pid)
    try:
        _ptrace(_PTRACE_SEIZE, tid)
    except PermissionError as exc:
        raise RemoteSyscallUnsupported(exc.errno, f"ptrace is not allowed here: {exc}") from exc
    try:
        result = _call_stopped(tid, insn, number, args)
    finally:
        try:
            _ptrace(_PTRACE_DETACH, tid)
        except OSError:
            _reap(tid)  # it died while traced: only its tracer can reap it
    return result - 2**64 if result >= 2**63 else result


def _reap(tid: int) -> None:
    """Collect a traced thread that exited, so its process can be reaped in turn."""
    with contextlib.suppress(ChildProcessError, OSError):
        for _ in range(50):
            if os.waitpid(tid, os.WNOHANG | _WALL)[0] == tid:
                return
            time.sleep(0.002)


def _call_stopped(tid: int, insn: int, number: int, args: tuple[int, ...]) -> int:
    """Stop the seized thread ``tid``, make the call, put its registers back."""
    _ptrace(_PTRACE_INTERRUPT, tid)
    status = _wait_stop(tid)
    if status >> 16 != _PTRACE_EVENT_STOP:  # a signal stopped it first: let it go on
        _ptrace(_PTRACE_DETACH, tid, 0, os.WSTOPSIG(status))
        raise InterruptedError(f"thread {tid} got a signal; the call was not made")
    saved = _Regs()
    _ptrace(_PTRACE_GETREGS, tid, 0, saved)
    regs = _Regs.from_buffer_copy(saved)
    regs.rip, regs.rax = insn, number
    regs.orig_rax = 2**64 - 1  # not inside a system call: nothing to restart
    for name, value in zip(_ARG_REGS, args, strict=False):
        setattr(regs, name, value & (2**64 - 1))
    _ptrace(_PTRACE_SETREGS, tid, 0, regs)
    try:
        _ptrace(_PTRACE_SINGLESTEP, tid)
        status = _wait_stop(tid)
        after = _Regs()
        _ptrace(_PTRACE_GETREGS, tid, 0, after)
        # Only a thread that stepped over the instruction made the call; any other stop
        # (a signal, another ptrace stop) means it did not, and its rax is no answer.
        if after.rip != insn + len(_SYSCALL_INSN):
            _ptrace(_PTRACE_SETREGS, tid, 0, saved)
            signal_ = os.WSTOPSIG(status) if status >> 16 == 0 else 0
            _ptrace(_PTRACE_DETACH, tid, 0, 0 if signal_ == signal.SIGTRAP else signal_)
            raise InterruptedError(f"thread {tid} stopped before the call")
    finally:
        # Whatever happened, the thread must go on from where it was: the call it
        # was blocked in restarts. (Fails only if it is gone, or runs on already.)
        with contextlib.suppress(OSError):
            _ptrace(_PTRACE_SETREGS, tid, 0, saved)
    return int(after.rax)


def take_fd(pid: int, remote_fd: int) -> int:
    """A descriptor of the daemon's for ``pid``'s descriptor ``remote_fd`` (close-on-exec)."""
    pidfd = _libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_open({pid}): {os.strerror(err)}")
    try:
        fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, remote_fd, 0)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd({pid}, {remote_fd}): {os.strerror(err)}")
        return int(fd)
    finally:
        os.close(pidfd)
