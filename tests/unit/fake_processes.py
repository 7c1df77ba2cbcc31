"""The guest agent's background processes (the ``proc_*`` ops), played in-process for FakeVM.

Each process is a scripted asyncio task writing into a ring of output with
global offsets, as the agent's reader threads do (docs/guest-agent.md,
"Processes"); ``proc_read`` follows the protocol: gaps, waits, cuts at
``max_bytes``, ``eof``. The scripts, chosen by ``argv[0]``:

- ``echo A B``: prints ``A B``; ``exit N``: prints ``exit N`` on stderr, exits N;
- ``sleep S``: sleeps; ``cat``: copies stdin to stdout until EOF;
- ``count N SECS``: prints 1..N, one line every SECS;
- ``hex HEX``: writes those bytes; ``flood``: writes 64 KiB blocks until killed;
- ``nosuch``: does not exist (FileNotFoundError);
- ``whoami`` (or ``/bin/sh -c 'id -un'``): prints the user it runs as;
- ``serve PORT``: says it serves on PORT, then runs until killed (an image's service);
- ``/bin/bash [-l] -c LINE`` (E2B's ``commands.run``, its interpreter's bash): LINE's script;
- anything else (``/bin/sh -c LINE`` among them): prints its arguments, like FakeVM's exec.

What the agent answers (fields, chunks, errors and their messages, exit codes) is
held to the real agent's by tests/unit/test_process_contract.py, which runs the
same cases against both. Not modelled: a pty's line discipline (the real one
echoes input and writes ``\\r\\n`` for ``\\n``; here a pty is a pipe tagged
``pty``) and stopped processes (SIGSTOP and friends change nothing here).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal as signals
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from forkd.errors import AgentError

RING_BYTES = 4 << 20
MAX_RUNNING = 64
MAX_EXITED_KEPT = 64  # the most recent exited processes the agent remembers
MAX_READ_BYTES = 1 << 20
MAX_WAIT_S = 30.0
MAX_PTY_SIDE = 1000
# Signals a process ignores by default (it runs on), and those that stop it (it
# still runs, as far as the agent can tell): neither ends it.
HARMLESS_SIGNALS = frozenset(
    {
        signals.SIGCHLD,
        signals.SIGCONT,
        signals.SIGURG,
        signals.SIGWINCH,
        signals.SIGSTOP,
        signals.SIGTSTP,
        signals.SIGTTIN,
        signals.SIGTTOU,
    }
)


def refusal(kind: str, message: str) -> AgentError:
    return AgentError(message, kind=kind)


@dataclass
class FakeProcess:
    pid: int
    cmd: list[str]
    pty: bool
    stdin_open: bool
    ring_bytes: int
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    exit_code: int | None = None
    ring: deque[tuple[str, int, bytes]] = field(default_factory=deque)
    held: int = 0  # bytes in the ring
    output_start: int = 0
    output_end: int = 0
    stdin: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    size: tuple[int, int] | None = None
    user: str = "root"
    stdin_closed: bool = False  # by a write with eof (a pty's eof is a ^D: it stays open)

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def info(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "cmd": self.cmd,
            "pty": self.pty,
            "stdin": self.stdin_open,
            "running": self.running,
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "output_start": self.output_start,
            "output_end": self.output_end,
        }

    def write(self, stream: str, data: bytes) -> None:
        if self.pty:
            stream = "pty"
        self.ring.append((stream, self.output_end, data))
        self.output_end += len(data)
        self.held += len(data)
        while self.held > self.ring_bytes:
            _, offset, old = self.ring.popleft()
            self.held -= len(old)
            self.output_start = offset + len(old)
        self._wake()

    def end(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.ended_at = time.time()
            self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def read(self, offset: int, max_bytes: int) -> dict[str, Any]:
        """As the agent answers a raw read (the host always asks for one): one chunk
        with its ``size`` for each run of one stream, the bytes in ``raw`` (if any)."""
        gap = None
        if offset < self.output_start:
            gap = {"from": offset, "to": self.output_start}
            offset = self.output_start
        chunks: list[dict[str, Any]] = []
        pieces, left = [], max_bytes
        for stream, start, data in self.ring:
            if start + len(data) <= offset or left == 0:
                continue
            piece = data[max(0, offset - start) :][:left]
            if chunks and chunks[-1]["stream"] == stream:
                chunks[-1]["size"] += len(piece)
            else:
                chunks.append({"stream": stream, "offset": max(start, offset), "size": len(piece)})
            pieces.append(piece)
            left -= len(piece)
            offset = max(start, offset) + len(piece)
        answer = {
            "chunks": chunks,
            "next_offset": offset,
            "gap": gap,
            "running": self.running,
            "exit_code": self.exit_code,
            "eof": not self.running and offset == self.output_end,
        }
        if pieces:  # no bytes follow the answer: it has no "raw"
            answer["raw"] = b"".join(pieces)
        return answer


async def _script(proc: FakeProcess) -> int:
    name, args = proc.cmd[0], proc.cmd[1:]
    cmd = proc.cmd
    if cmd[0] == "/bin/bash" and cmd[1:-1] in (["-c"], ["-l", "-c"]):  # E2B's commands, bash
        name, *args = shlex.split(cmd[-1]) or [""]
    if proc.cmd == ["/bin/sh", "-c", "id -un"]:
        name = "whoami"
    if name == "echo":
        proc.write("stdout", (" ".join(args) + "\n").encode())
    elif name == "exit":
        proc.write("stderr", f"exit {args[0]}\n".encode())
        return int(args[0])
    elif name == "sleep":
        await asyncio.sleep(float(args[0]))
    elif name == "cat":
        while (data := await proc.stdin.get()) is not None:
            proc.write("stdout", data)
    elif name == "count":
        for i in range(1, int(args[0]) + 1):
            proc.write("stdout", f"{i}\n".encode())
            await asyncio.sleep(float(args[1]))
    elif name == "serve":
        proc.write("stdout", f"serving on port {args[0]}\n".encode())
        await asyncio.Event().wait()
    elif name == "whoami":
        proc.write("stdout", f"{proc.user}\n".encode())
    elif name == "hex":
        proc.write("stdout", bytes.fromhex(args[0]))
    elif name == "flood":
        while True:
            proc.write("stdout", b"x" * (64 << 10))
            await asyncio.sleep(0.001)
    else:
        proc.write("stdout", (" ".join(args) + "\n").encode())
    return 0


async def _run(proc: FakeProcess, timeout_s: float | None) -> None:
    try:
        proc.end(await asyncio.wait_for(_script(proc), timeout_s))
    except TimeoutError:
        proc.end(124)
    except (ValueError, IndexError) as exc:  # a script given arguments it cannot use
        proc.write("stderr", f"{exc}\n".encode())
        proc.end(2)


class FakeProcesses:
    """What one fake guest agent knows of its background processes."""

    def __init__(self) -> None:
        self.procs: dict[int, FakeProcess] = {}
        self.ring_bytes = RING_BYTES
        self.reads: list[tuple[int, int]] = []  # (pid, offset) of every proc_read
        self.asks: list[tuple[int, int, float]] = []  # (max_bytes, min_bytes, linger_s) of each
        self._next_pid = 100

    def _get(self, pid: int) -> FakeProcess:
        if pid not in self.procs:
            raise refusal("ProcessLookupError", f"no background process with pid {pid}")
        return self.procs[pid]

    def start(
        self,
        cmd: list[str] | str,
        *,
        stdin: bool = False,
        pty: dict[str, int] | None = None,
        timeout_s: float | None = None,
        user: str = "root",
        **_: Any,
    ) -> dict[str, Any]:
        argv = _argv(cmd)
        if pty is not None:
            for side in ("cols", "rows"):
                _check_int(pty.get(side), side, 1, MAX_PTY_SIDE)
        if timeout_s is not None and not timeout_s > 0:
            raise refusal("ValueError", "'timeout_s' must be > 0 and finite")
        if sum(p.running for p in self.procs.values()) >= MAX_RUNNING:
            raise refusal(
                "BlockingIOError", f"too many background processes running (at most {MAX_RUNNING})"
            )
        if argv[0] == "nosuch":
            raise refusal("FileNotFoundError", "[Errno 2] No such file or directory: 'nosuch'")
        self._next_pid += 1
        proc = FakeProcess(
            self._next_pid,
            argv,
            pty is not None,
            stdin or pty is not None,
            self.ring_bytes,
            user=user,
        )
        if pty is not None:
            proc.size = (pty["cols"], pty["rows"])
        if not proc.stdin_open:
            proc.stdin.put_nowait(None)
        proc.task = asyncio.get_running_loop().create_task(_run(proc, timeout_s))
        self.procs[proc.pid] = proc
        self._forget_oldest_exited()
        return proc.info()

    def _forget_oldest_exited(self) -> None:
        exited = sorted(
            (p for p in self.procs.values() if not p.running), key=lambda p: p.ended_at or 0.0
        )
        for proc in exited[: max(0, len(exited) - MAX_EXITED_KEPT)]:
            del self.procs[proc.pid]

    def list(self) -> list[dict[str, Any]]:
        self._forget_oldest_exited()
        return [p.info() for p in self.procs.values()]

    def info(self, pid: int) -> dict[str, Any]:
        return self._get(pid).info()

    async def read(self, pid: int, offset: int, wait_s: float, max_bytes: int) -> dict[str, Any]:
        self.reads.append((pid, offset))
        _check_int(offset, "offset", 0, None)
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise refusal(
                "ValueError", f"'wait_s' must be a number of seconds from 0 to {MAX_WAIT_S:g}"
            )
        _check_int(max_bytes, "max_bytes", 1, MAX_READ_BYTES)
        proc = self._get(pid)
        if offset > proc.output_end:
            raise refusal(
                "ValueError", f"offset {offset} is past the end of the output ({proc.output_end})"
            )
        if offset == proc.output_end and proc.running and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.changed.wait(), wait_s)
        return proc.read(offset, max_bytes)

    def stdin(self, pid: int, data: bytes, eof: bool) -> int:
        proc = self._get(pid)
        if not proc.stdin_open:
            raise refusal("ValueError", f"process {pid} was started without stdin")
        if not proc.running or proc.stdin_closed:
            state = "has exited" if not proc.running else "has its stdin closed"
            raise refusal("BrokenPipeError", f"[Errno 32] process {pid} {state}")
        if data:
            proc.stdin.put_nowait(data)
        if eof:
            proc.stdin.put_nowait(None)
            proc.stdin_closed = not proc.pty
        return len(data)

    def signal(self, pid: int, sig: int | str) -> None:
        num = _signal_number(sig)
        proc = self._get(pid)
        if proc.running and proc.task is not None and num not in HARMLESS_SIGNALS:
            proc.task.cancel()
            proc.end(128 + num)

    def resize(self, pid: int, cols: int, rows: int) -> None:
        _check_int(cols, "cols", 1, MAX_PTY_SIDE)
        _check_int(rows, "rows", 1, MAX_PTY_SIDE)
        proc = self._get(pid)
        if not proc.pty:
            raise refusal("ValueError", f"process {pid} has no pty")
        proc.size = (cols, rows)


def _argv(cmd: list[str] | str) -> list[str]:
    if isinstance(cmd, str) and cmd:
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        argv = list(cmd)
    else:
        raise refusal(
            "ValueError", "'cmd' must be a non-empty string or a non-empty list of strings"
        )
    if any("\0" in arg for arg in argv):
        raise refusal("ValueError", "'cmd' must not contain a NUL byte")
    return argv


def _check_int(value: Any, name: str, low: int, high: int | None) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise refusal("ValueError", f"{name!r} must be an integer {bounds}")


def _signal_number(sig: int | str) -> int:
    """As the agent reads a signal: a name with or without SIG, any case, or a number."""
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        try:
            return int(signals.Signals[name])
        except KeyError:
            raise refusal("ValueError", f"unknown signal: {sig!r}") from None
    if isinstance(sig, int) and not isinstance(sig, bool) and sig in signals.valid_signals():
        return sig
    raise refusal(
        "ValueError", '\'signal\' must be a signal number or a name like "SIGTERM" or "TERM"'
    )
