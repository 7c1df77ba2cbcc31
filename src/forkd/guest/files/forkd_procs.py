"""Background processes of the forkd guest agent: spawned, drained into output rings, reaped.

Imported by forkd_agent_proc_handlers.py, which owns the ops (``proc_*``, see
docs/guest-agent.md) and turns what this module returns into answers. This
module knows processes only. Standard library only, like the agent.

Each process has its own session and process group. Reader threads drain its
stdout and stderr (or its pseudo-terminal) into an OutputRing as soon as
output arrives, so a process never blocks on a slow host; a reaper thread
waits for it and records its exit. All state is memory, so a fork of the VM
carries every process, ring and offset into each child.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import operator
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import forkd_exec

# Tiny writes alternating between stdout and stderr make one chunk each: the ring
# holds at most RING_MAX_CHUNKS, which bounds the memory they take beside their bytes.
from forkd.agent_wire import RING_MAX_CHUNKS

RING_BYTES = 4 * 1024 * 1024  # output kept per process; the oldest is dropped first
# Reads shorter than this are copied into a chunk that grows up to CHUNK_MERGE_BYTES
# with the next short reads of its stream; longer ones are kept as they came, without
# a copy (a copy costs on a TCG guest), so at most RING_BYTES / this of them.
SMALL_READ_BYTES = 4 * 1024
CHUNK_MERGE_BYTES = 64 * 1024
READ_BYTES = 256 * 1024  # as big as the pipe: one read takes what a nap let in
PIPE_BYTES = 256 * 1024  # each output pipe's size (the kernel's default is 64 KiB)
# After a read of at least NAP_AFTER_BYTES (a writer in full flow), a reader thread
# sleeps NAP_S before the next, so the pipe fills meanwhile: on a guest whose one
# vCPU the writer keeps busy, each read, wakeup and switch between the writer and
# the agent costs much, and fewer, larger reads leave more of it to the writer and
# to the answers (under TCG: 8 reads a MiB instead of 25). Short output (a line,
# an echo) is read at once, never held.
NAP_AFTER_BYTES = SMALL_READ_BYTES
NAP_S = 0.001
MAX_RUNNING = 64
MAX_EXITED_KEPT = 64
# After the exit: how long output from leftover holders of the pipes (a background
# job) is still kept. Later output is read and dropped, as exec does.
OUTPUT_LINGER_S = 0.5
STDIN_STALL_S = 5.0  # a stdin write returns what was taken once the process takes nothing this long
PTY_TERM = "xterm-256color"
PTY_EOF = b"\x04"  # ^D: end of input at the start of a line, in canonical mode
POLL_IDLE_S = 0.05  # a poll that reports no data and no end: do not spin
WAKE_NONE = 1 << 62  # no reader waits


Gap = tuple[int, int]  # a lost range of offsets: [from, to)


@dataclass
class _Chunk:
    stream: str
    offset: int
    data: bytearray | bytes  # bytes: one read of SMALL_READ_BYTES or more, kept without a copy


@dataclass(frozen=True)
class OutputPiece:
    """Bytes of one stream ("stdout", "stderr" or "pty") starting at a global offset."""

    stream: str
    offset: int
    data: bytes


class OutputRing:
    """One process's output: a single byte sequence with global offsets, of which
    the newest ``capacity`` bytes (in at most ``max_chunks`` chunks) are held.

    Not thread-safe: its owner holds a lock around every call.
    """

    def __init__(self, capacity: int = RING_BYTES, max_chunks: int = RING_MAX_CHUNKS) -> None:
        self._capacity = capacity
        self._max_chunks = max_chunks
        self._chunks: list[_Chunk] = []
        # Index of the oldest chunk held. Dropped entries leave the list in batches
        # (one del of many, not one of each), but their bytes are let go at once.
        self._first = 0
        self._held = 0
        self.start = 0  # oldest offset held
        self.end = 0  # offset after the last byte appended

    def append(self, stream: str, data: bytes) -> None:
        last = self._chunks[-1] if len(self._chunks) > self._first else None
        if len(data) >= SMALL_READ_BYTES:
            self._chunks.append(_Chunk(stream, self.end, data))
        elif (
            last is not None
            and last.stream == stream
            and isinstance(last.data, bytearray)
            and len(last.data) < CHUNK_MERGE_BYTES
        ):
            last.data += data
        else:
            self._chunks.append(_Chunk(stream, self.end, bytearray(data)))
        self.end += len(data)
        self._held += len(data)
        self._drop_oldest()

    def _drop_oldest(self) -> None:
        # Never the newest chunk: it is at most one read or CHUNK_MERGE_BYTES and a
        # short read long, far below the capacity.
        while self._held > self._capacity or len(self._chunks) - self._first > self._max_chunks:
            dropped = self._chunks[self._first]
            self._held -= len(dropped.data)
            # Its bytes go now, not with its entry: a batch waits for over 1024
            # entries, and at up to one read (256 KiB) each, a ring (kept after the
            # exit too) held hundreds of MiB it had dropped, enough to run the agent
            # out of memory after a few large outputs.
            dropped.data = b""
            self._first += 1
        self.start = self._chunks[self._first].offset
        if self._first > 1024 and self._first * 2 > len(self._chunks):
            del self._chunks[: self._first]
            self._first = 0

    def check_offset(self, offset: int) -> None:
        if offset > self.end:
            raise ValueError(f"offset {offset} is past the end of the output ({self.end})")

    def read(self, offset: int, max_bytes: int) -> tuple[list[OutputPiece], int, Gap | None]:
        """Up to ``max_bytes`` from ``offset`` on: (pieces, next offset, lost range or None)."""
        self.check_offset(offset)
        gap = None
        if offset < self.start:
            gap = (offset, self.start)
            offset = self.start
        pieces: list[OutputPiece] = []
        room = max_bytes
        index = bisect.bisect_right(
            self._chunks, offset, lo=self._first, key=operator.attrgetter("offset")
        )
        index = max(self._first, index - 1)  # the chunk holding ``offset``
        while room > 0 and index < len(self._chunks):
            chunk = self._chunks[index]
            index += 1
            skip = offset - chunk.offset
            if skip >= len(chunk.data):
                continue
            if isinstance(chunk.data, bytes) and skip == 0 and room >= len(chunk.data):
                data = chunk.data  # a whole read kept as it was: immutable, shared
            else:
                data = bytes(memoryview(chunk.data)[skip : skip + room])  # one copy, not two
            pieces.append(OutputPiece(chunk.stream, offset, data))
            offset += len(data)
            room -= len(data)
        return pieces, offset, gap


@dataclass(frozen=True)
class ProcessSpec:
    """What to start. ``env`` is the whole environment; ``pty_size`` is (cols, rows)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    stdin: bool = False
    pty_size: tuple[int, int] | None = None
    timeout_s: float | None = None
    identity: Any = None  # a forkd_identity.Identity; None: the agent's own (root)


@dataclass(frozen=True)
class ProcessStatus:
    pid: int
    argv: list[str]
    pty: bool
    stdin: bool  # takes stdin writes: started with stdin, or on a pty
    started_at: float
    ended_at: float | None
    returncode: int | None  # as subprocess reports it: -S when killed by signal S
    timed_out: bool
    output_start: int
    output_end: int


@dataclass(frozen=True)
class OutputSlice:
    pieces: list[OutputPiece]
    next_offset: int
    gap: Gap | None
    status: ProcessStatus
    complete: bool  # output collection ended and everything up to its end was returned


def _pipe_fds(spec: ProcessSpec) -> tuple[dict[str, int], list[int]]:
    """The fds for Popen's stdin/stdout/stderr, and the ones the agent keeps:
    [pty master], or [stdin writer (-1 for none), stdout reader, stderr reader]."""
    opened: list[int] = []
    try:
        if spec.pty_size is not None:
            master, slave = os.openpty()  # both non-inheritable; Popen dup2s the slave
            opened += [master, slave]
            cols, rows = spec.pty_size
            set_terminal_size(slave, cols, rows)
            return {"stdin": slave, "stdout": slave, "stderr": slave}, [master]
        stdin_read, stdin_write = subprocess.DEVNULL, -1
        if spec.stdin:
            stdin_read, stdin_write = os.pipe()
            opened += [stdin_read, stdin_write]
        out_read, out_write = os.pipe()
        opened += [out_read, out_write]
        err_read, err_write = os.pipe()
        opened += [err_read, err_write]
        for fd in (out_read, err_read):
            with contextlib.suppress(OSError):  # over the system's limits: the default size
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except BaseException:
        _close_fds(opened)
        raise
    child = {"stdin": stdin_read, "stdout": out_write, "stderr": err_write}
    return child, [stdin_write, out_read, err_read]


def set_terminal_size(fd: int, cols: int, rows: int) -> None:
    # struct winsize { unsigned short ws_row, ws_col, ws_xpixel, ws_ypixel; }
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_terminal() -> None:
    # Runs in the child after setsid(): stdin is the pty slave, which becomes the
    # session's controlling terminal (for /dev/tty, job control and SIGWINCH).
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _spawn(spec: ProcessSpec) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start the process; return it and the fds the agent keeps."""
    child_fds, kept_fds = _pipe_fds(spec)
    env = spec.env if spec.pty_size is None else {"TERM": PTY_TERM, **spec.env}
    try:
        popen = subprocess.Popen(
            spec.argv,
            cwd=spec.cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_take_controlling_terminal if spec.pty_size is not None else None,
            stdin=child_fds["stdin"],
            stdout=child_fds["stdout"],
            stderr=child_fds["stderr"],
            **forkd_exec.as_user(spec.identity),
        )
    except BaseException:
        _close_fds(kept_fds)
        raise
    finally:
        _close_fds({fd for fd in child_fds.values() if fd >= 0})
    for fd in kept_fds[:1]:  # the stdin writer (or the pty master): writes must not block
        if fd >= 0:
            os.set_blocking(fd, False)
    return popen, kept_fds


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _write_until_stalled(fd: int, data: bytes, stall_s: float) -> int:
    """Write to a non-blocking fd until done or the reader takes nothing for ``stall_s``."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    view = memoryview(data)
    written = 0
    writable = True  # the last poll said so (or there was none yet)
    while written < len(data):
        try:
            written += os.write(fd, view[written:])
            continue
        except BlockingIOError:
            if not writable:  # a hang-up or error without room: do not spin
                break
        except BrokenPipeError:
            if written == 0:
                raise
            break
        events = poller.poll(stall_s * 1000)
        if not events:
            break
        writable = any(ev & select.POLLOUT for _, ev in events)
    return written


class BackgroundProcess:
    """One started process: its output ring, stdin, exit and timeout."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.argv = list(spec.argv)
        self.pty = spec.pty_size is not None
        self.stdin = spec.stdin or self.pty
        self._cond = threading.Condition()  # guards the fields below; wakes readers
        self._ring = OutputRing()
        self._returncode: int | None = None
        self._timed_out = False
        self._ended_at: float | None = None
        self._output_closed = False
        # The end of output that a waiting reader needs: a reader thread wakes readers
        # only once the output reaches it, not at each read (a switch each).
        self._wake_at = 0
        self._stdin_lock = threading.Lock()  # one writer at a time; guards the fd below
        self._popen, fds = _spawn(spec)
        self.pid = self._popen.pid
        self.started_at = time.time()
        self._input_fd: int | None = fds[0] if fds[0] >= 0 else None  # stdin writer or pty master
        readers = [("pty", fds[0])] if self.pty else [("stdout", fds[1]), ("stderr", fds[2])]
        self._readers = [
            threading.Thread(
                target=self._drain, args=(fd, stream), name=f"proc-{self.pid}-{stream}", daemon=True
            )
            for stream, fd in readers
        ]
        try:
            for reader in self._readers:
                reader.start()
            threading.Thread(
                target=self._reap, args=(spec.timeout_s,), name=f"proc-{self.pid}", daemon=True
            ).start()
        except RuntimeError:  # no thread for it: do not leave it running unwatched
            self._kill_group(signal.SIGKILL)
            self._popen.wait()
            if not any(reader.is_alive() for reader in self._readers):
                _close_fds(fds)  # else a started reader still reads one of them
            raise

    @property
    def running(self) -> bool:
        return self._returncode is None

    def status(self) -> ProcessStatus:
        with self._cond:
            return self._status_locked()

    def _status_locked(self) -> ProcessStatus:
        return ProcessStatus(
            pid=self.pid,
            argv=self.argv,
            pty=self.pty,
            stdin=self.stdin,
            started_at=self.started_at,
            ended_at=self._ended_at,
            returncode=self._returncode,
            timed_out=self._timed_out,
            output_start=self._ring.start,
            output_end=self._ring.end,
        )

    # ------------------------------------------------------------------ output

    def read(
        self, offset: int, max_bytes: int, wait_s: float, min_bytes: int = 1, linger_s: float = 0.0
    ) -> OutputSlice:
        """Output from ``offset`` on; if there is none yet, wait up to ``wait_s`` for some,
        then up to ``linger_s`` more for ``min_bytes`` in all (fewer, larger answers)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            if offset > self._ring.end:
                raise ValueError(
                    f"offset {offset} is past the end of the output ({self._ring.end})"
                )
            while self._ring.end <= offset and not self._output_closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wake_at = min(self._wake_at, offset + 1)
                self._cond.wait(remaining)
            linger_end = time.monotonic() + linger_s
            while self._ring.end - offset < min_bytes and not self._output_closed:
                remaining = linger_end - time.monotonic()
                if remaining <= 0 or self._ring.end <= offset:
                    break
                self._wake_at = min(self._wake_at, offset + min_bytes)
                self._cond.wait(remaining)
            pieces, next_offset, gap = self._ring.read(offset, max_bytes)
            return OutputSlice(
                pieces=pieces,
                next_offset=next_offset,
                gap=gap,
                status=self._status_locked(),
                complete=self._output_closed and next_offset == self._ring.end,
            )

    def _drain(self, fd: int, stream: str) -> None:
        """Read one pipe (or the pty master) until its end, into the ring."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                try:
                    data = os.read(fd, READ_BYTES)
                except BlockingIOError:  # the pty master is non-blocking for stdin writes
                    events = poller.poll()
                    if not any(ev & select.POLLIN for _, ev in events):
                        time.sleep(POLL_IDLE_S)
                    continue
                except OSError:
                    # EIO: every holder of the pty slave closed it, the pty's end of
                    # file. Any other error ends the stream too: it cannot be retried.
                    return
                if not data:
                    return
                with self._cond:
                    if not self._output_closed:
                        self._ring.append(stream, data)
                        if self._ring.end >= self._wake_at:
                            self._wake_at = WAKE_NONE  # each woken reader sets it again
                            self._cond.notify_all()
                if len(data) >= NAP_AFTER_BYTES:
                    time.sleep(NAP_S)
        finally:
            if not self.pty:  # the pty master stays open for stdin and resize until the reaper
                os.close(fd)

    # ------------------------------------------------------------------ exit

    def _reap(self, timeout_s: float | None) -> None:
        timer = None
        if timeout_s is not None:
            timer = threading.Timer(timeout_s, self._time_out)
            timer.daemon = True
            timer.start()
        returncode = self._popen.wait()
        if timer is not None:
            timer.cancel()
        with self._cond:
            self._returncode = returncode
            self._ended_at = time.time()
            self._cond.notify_all()
        if not self.pty:
            self._close_input()  # its reader is gone: later writes fail with BrokenPipeError
        # Output written before the exit is in the pipes already; a leftover holder
        # (a background job) may keep them open much longer, so wait a bounded time.
        linger_end = time.monotonic() + OUTPUT_LINGER_S
        for reader in self._readers:
            reader.join(max(0.0, linger_end - time.monotonic()))
        with self._cond:
            self._output_closed = True
            self._cond.notify_all()
        for reader in self._readers:
            reader.join()  # the pty master must outlive its reader
        self._close_input()

    def _time_out(self) -> None:
        with self._cond:
            if self._returncode is not None:
                return
            self._timed_out = True
        self._kill_group(signal.SIGKILL)

    def _kill_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def _close_input(self) -> None:
        with self._stdin_lock:
            if self._input_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._input_fd)
                self._input_fd = None

    # ------------------------------------------------------------------ control

    def write_stdin(self, data: bytes, eof: bool) -> int:
        """Write ``data`` (then close stdin, or send ^D on a pty); the bytes taken."""
        if not self.stdin:
            raise ValueError(f"process {self.pid} was started without stdin")
        with self._stdin_lock:
            if not self.running or self._input_fd is None:
                state = "has exited" if not self.running else "has its stdin closed"
                raise BrokenPipeError(errno.EPIPE, f"process {self.pid} {state}")
            written = _write_until_stalled(self._input_fd, data, STDIN_STALL_S)
            if eof and written == len(data):
                if self.pty:
                    _write_until_stalled(self._input_fd, PTY_EOF, STDIN_STALL_S)
                else:
                    os.close(self._input_fd)
                    self._input_fd = None
            return written

    def send_signal(self, signum: int) -> None:
        """Signal the process group; nothing once the process has exited (its pid
        may belong to another process by then)."""
        with self._cond:
            if not self.running:
                return
        self._kill_group(signum)

    def resize(self, cols: int, rows: int) -> None:
        """Set the pty's size (its foreground group gets SIGWINCH); nothing after the exit."""
        if not self.pty:
            raise ValueError(f"process {self.pid} has no pty")
        with self._stdin_lock:
            if self._input_fd is not None:
                set_terminal_size(self._input_fd, cols, rows)


class ProcessTable:
    """The agent's background processes by pid: the running ones and the most recent exited."""

    def __init__(self, max_running: int = MAX_RUNNING, max_exited: int = MAX_EXITED_KEPT) -> None:
        self._max_running = max_running
        self._max_exited = max_exited
        self._lock = threading.Lock()
        self._by_pid: dict[int, BackgroundProcess] = {}
        self._starting = 0  # slots taken by starts still spawning

    def start(self, spec: ProcessSpec) -> BackgroundProcess:
        with self._lock:
            running = sum(proc.running for proc in self._by_pid.values()) + self._starting
            if running >= self._max_running:
                raise BlockingIOError(
                    f"too many background processes running (at most {self._max_running})"
                )
            self._starting += 1
        try:
            proc = BackgroundProcess(spec)
        except BaseException:
            with self._lock:
                self._starting -= 1
            raise
        with self._lock:
            self._starting -= 1
            self._by_pid[proc.pid] = proc  # replaces an exited one whose pid was reused
            self._prune_locked()
        return proc

    def get(self, pid: int) -> BackgroundProcess:
        with self._lock:
            proc = self._by_pid.get(pid)
        if proc is None:
            raise ProcessLookupError(f"no background process with pid {pid}")
        return proc

    def list(self) -> list[BackgroundProcess]:
        """Running ones and the most recent exited ones, oldest start first."""
        with self._lock:
            self._prune_locked()
            procs = list(self._by_pid.values())
        return sorted(procs, key=lambda proc: (proc.started_at, proc.pid))

    def _prune_locked(self) -> None:
        exited = [proc for proc in self._by_pid.values() if not proc.running]
        if len(exited) <= self._max_exited:
            return
        exited.sort(key=lambda proc: proc.status().ended_at or 0.0)
        for proc in exited[: len(exited) - self._max_exited]:
            del self._by_pid[proc.pid]
