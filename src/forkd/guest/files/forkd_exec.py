"""The agent's ``exec``: run a program to its end and answer with its output.

Imported by forkd_agent_handlers.py from its own directory. Standard library only.

One request thread does all of an exec's waiting in one ``poll``: the
program's stdout and stderr, its stdin (written as the pipe takes it), its exit
(a pidfd) and its deadline. No thread is started per exec: under TCG every
thread a guest starts costs thousands of freshly translated blocks in a
forked VM, and an exec used to start four (two readers, a stdin feeder and a
timer).

Pipes a background process still holds once the answer is due (``cmd &``) go
to one shared drainer thread, which reads and drops what they write until they
close: the background process is neither blocked nor killed by SIGPIPE.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from typing import Any

from forkd import agent_wire as wire
from forkd.agent_wire import MAX_OUTPUT_BYTES  # kept of each stream; the rest is truncated

KILL_GRACE_S = 0.5  # after a timeout kill: how long to wait for the output
LINGER_S = 0.5  # after a normal exit: how long background holders of the pipes may keep us
READ_BYTES = 65536
NO_PIDFD_POLL_S = 0.05  # without pidfds (Linux < 5.3), how often to look for the exit

EXIT_TIMEOUT = 124
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

IN_FLAGS = select.POLLIN | select.POLLHUP | select.POLLERR
OUT_FLAGS = select.POLLOUT | select.POLLHUP | select.POLLERR


def exit_code(returncode: int) -> int:
    """A shell's exit code for a Popen returncode (killed by N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def spawn_failure(exc: OSError, argv: list[str], start: float) -> wire.ExecAnswer:
    """Answer like a shell does when a program cannot be started."""
    code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_CANNOT_EXECUTE
    what = exc.filename if exc.filename is not None else argv[0]
    return {
        "exit_code": code,
        "stdout": "",
        "stderr": f"{what}: {exc.strerror or exc}\n",
        "timed_out": False,
        "stdout_truncated": False,
        "stderr_truncated": False,
        "duration_ms": (time.monotonic() - start) * 1000.0,
    }


def run(
    argv: list[str],
    cwd: str | None,
    env: dict[str, str],
    stdin: str | None,
    timeout: float,
    identity: Any = None,
) -> wire.ExecAnswer:
    """Run ``argv`` in a session of its own (as ``identity``, a forkd_identity.Identity:
    default the agent's own); after ``timeout`` seconds its group is killed."""
    start = time.monotonic()
    # Before anything is made: a lone surrogate cannot be encoded.
    data = b"" if stdin is None else stdin.encode("utf-8", errors="surrogateescape")
    # Our own pipes, so that their read ends are plain fds this module owns
    # (and may hand to the drainer), not Popen's file objects.
    fds: list[int] = []
    try:
        fds += os.pipe2(os.O_CLOEXEC)
        fds += os.pipe2(os.O_CLOEXEC)
        fds += os.pipe2(os.O_CLOEXEC) if stdin is not None else (-1, -1)
    except BaseException:
        _close(*fds)
        raise
    out_r, out_w, err_r, err_w, in_r, in_w = fds
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL if in_r < 0 else in_r,
            stdout=out_w,
            stderr=err_w,
            start_new_session=True,
            **as_user(identity),
        )
    except BaseException as exc:
        _close(out_r, err_r, in_w)
        if isinstance(exc, OSError):
            return spawn_failure(exc, argv, start)
        raise
    finally:
        _close(out_w, err_w, in_r)  # the program has its copies
    return _Run(proc, (out_r, err_r, in_w), data, start + timeout).wait(start)


def as_user(identity: Any) -> dict[str, Any]:
    """Popen's arguments that run a program as ``identity`` (none for root or None)."""
    if identity is None or (identity.uid == 0 and identity.gid == 0 and identity.groups == (0,)):
        return {}
    return {"user": identity.uid, "group": identity.gid, "extra_groups": list(identity.groups)}


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


class _Output:
    """One stream's first ``MAX_OUTPUT_BYTES``, and whether more came."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = MAX_OUTPUT_BYTES - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        if len(chunk) > room:
            self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class _Run:
    """The waiting of one exec, on the calling thread."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        fds: tuple[int, int, int],
        stdin: bytes,
        deadline: float,
    ) -> None:
        self.proc = proc
        self.deadline = deadline
        self.poller = select.poll()
        out_fd, err_fd, in_fd = fds
        self.stdout, self.stderr = _Output(), _Output()
        self.outputs = {out_fd: self.stdout, err_fd: self.stderr}
        for fd in self.outputs:
            self.poller.register(fd, IN_FLAGS)
        self.stdin = memoryview(stdin)
        self.stdin_fd: int | None = None
        if in_fd >= 0:
            self.stdin_fd = in_fd
            os.set_blocking(in_fd, False)
            self.poller.register(in_fd, OUT_FLAGS)
        self.pidfd = _pidfd(proc.pid)
        if self.pidfd is not None:
            self.poller.register(self.pidfd, select.POLLIN)
        self.timed_out = False
        self.end_by: float | None = None  # set once it exited: how long its pipes may keep us

    def wait(self, start: float) -> wire.ExecAnswer:
        try:
            while self.proc.returncode is None or (self.outputs and self._before(self.end_by)):
                self._step()
        finally:
            self._let_go()
        if self.timed_out:
            code = EXIT_TIMEOUT
        else:
            assert self.proc.returncode is not None
            code = exit_code(self.proc.returncode)
        return {
            "exit_code": code,
            "stdout": self.stdout.text(),
            "stderr": self.stderr.text(),
            "timed_out": self.timed_out,
            "stdout_truncated": self.stdout.truncated,
            "stderr_truncated": self.stderr.truncated,
            "duration_ms": (time.monotonic() - start) * 1000.0,
        }

    @staticmethod
    def _before(moment: float | None) -> bool:
        return moment is None or time.monotonic() < moment

    def _step(self) -> None:
        """One poll and what it found: output, room for stdin, the exit or a deadline."""
        now = time.monotonic()
        if self.proc.returncode is None:
            if not self.timed_out and now >= self.deadline:
                self.timed_out = True
                kill_group(self.proc.pid)
            wake = None if self.timed_out else self.deadline
            if self.pidfd is None:  # nothing wakes us at the exit: look again soon
                soon = now + NO_PIDFD_POLL_S
                wake = soon if wake is None else min(wake, soon)
        else:
            wake = self.end_by
        wait_ms = None if wake is None else max(0, int((wake - now) * 1000) + 1)
        for fd, _ in self.poller.poll(wait_ms):
            if fd in self.outputs:
                self._read(fd)
            elif fd == self.stdin_fd:
                self._write_stdin()
        if self.proc.returncode is None and self.proc.poll() is not None:
            self._exited()

    def _exited(self) -> None:
        if self.pidfd is not None:
            self.poller.unregister(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        # Output written before the exit is already in the pipes; a background
        # process may hold them open for longer, so wait a bounded time only.
        self.end_by = time.monotonic() + (KILL_GRACE_S if self.timed_out else LINGER_S)

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, READ_BYTES)
        except OSError:
            chunk = b""
        if chunk:
            self.outputs[fd].add(chunk)
            return
        self.poller.unregister(fd)
        del self.outputs[fd]
        os.close(fd)

    def _write_stdin(self) -> None:
        assert self.stdin_fd is not None
        try:
            sent = os.write(self.stdin_fd, self.stdin[:READ_BYTES]) if self.stdin else 0
        except BlockingIOError:
            return
        except OSError:  # it exited or closed its stdin: not our problem
            sent, self.stdin = 0, self.stdin[:0]
        self.stdin = self.stdin[sent:]
        if not self.stdin:
            self.poller.unregister(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def _let_go(self) -> None:
        """Close what is done with; pipes still held by a background process are drained."""
        if self.pidfd is not None:
            os.close(self.pidfd)
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
        if self.outputs:
            DRAINER.take(list(self.outputs))


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python or Linux without pidfds
        return None


class Drainer:
    """One thread that reads and drops output of pipes nobody waits on any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._poller = select.poll()
        self._fds: set[int] = set()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None

    def take(self, fds: list[int]) -> None:
        with self._lock:
            if self._thread is None:
                self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                self._poller.register(self._wake_r, select.POLLIN)
                self._thread = threading.Thread(target=self._run, name="exec-drainer", daemon=True)
                self._thread.start()
            for fd in fds:
                self._fds.add(fd)
                self._poller.register(fd, IN_FLAGS)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")  # poll again, now with these fds

    def _run(self) -> None:
        while True:
            for fd, _ in self._poller.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                try:
                    more = os.read(fd, READ_BYTES)
                except OSError:
                    more = b""
                if not more:
                    with self._lock:
                        self._poller.unregister(fd)
                        self._fds.discard(fd)
                    os.close(fd)

    def holding(self) -> int:
        with self._lock:
            return len(self._fds)


DRAINER = Drainer()
