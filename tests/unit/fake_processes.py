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
- anything else (``/bin/sh -c LINE`` among them): prints its arguments, like FakeVM's exec.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal as signals
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from forkd.errors import AgentError

RING_BYTES = 4 << 20
MAX_RUNNING = 64


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

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def info(self) -> dict[str, Any]:
        return {"pid": self.pid, "cmd": self.cmd, "pty": self.pty, "stdin": self.stdin_open,
                "running": self.running, "exit_code": self.exit_code,
                "started_at": self.started_at, "ended_at": self.ended_at,
                "output_start": self.output_start, "output_end": self.output_end}  # fmt: skip

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
        gap = None
        if offset < self.output_start:
            gap = {"from": offset, "to": self.output_start}
            offset = self.output_start
        chunks, left = [], max_bytes
        for stream, start, data in self.ring:
            if start + len(data) <= offset or left == 0:
                continue
            piece = data[max(0, offset - start) :][:left]
            chunks.append({"stream": stream, "offset": max(start, offset),
                           "data": base64.b64encode(piece).decode()})  # fmt: skip
            left -= len(piece)
            offset = max(start, offset) + len(piece)
        return {"chunks": chunks, "next_offset": offset, "gap": gap, "running": self.running,
                "exit_code": self.exit_code,
                "eof": not self.running and offset == self.output_end}  # fmt: skip


async def _script(proc: FakeProcess) -> int:
    name, args = proc.cmd[0], proc.cmd[1:]
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
            raise refusal("ProcessLookupError", f"no process {pid}")
        return self.procs[pid]

    def start(self, cmd: list[str] | str, *, stdin: bool = False,
              pty: dict[str, int] | None = None, timeout_s: float | None = None,
              user: str = "root", **_: Any) -> dict[str, Any]:  # fmt: skip
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if argv[0] == "nosuch":
            raise refusal("FileNotFoundError", "[Errno 2] No such file or directory: 'nosuch'")
        if sum(p.running for p in self.procs.values()) >= MAX_RUNNING:
            raise refusal("BlockingIOError", f"more than {MAX_RUNNING} processes running")
        self._next_pid += 1
        proc = FakeProcess(self._next_pid, argv, pty is not None, stdin or pty is not None,
                           self.ring_bytes, user=user)  # fmt: skip
        if pty is not None:
            proc.size = (pty["cols"], pty["rows"])
        if not proc.stdin_open:
            proc.stdin.put_nowait(None)
        proc.task = asyncio.get_running_loop().create_task(_run(proc, timeout_s))
        self.procs[proc.pid] = proc
        return proc.info()

    def list(self) -> list[dict[str, Any]]:
        return [p.info() for p in self.procs.values()]

    def info(self, pid: int) -> dict[str, Any]:
        return self._get(pid).info()

    async def read(self, pid: int, offset: int, wait_s: float, max_bytes: int) -> dict[str, Any]:
        self.reads.append((pid, offset))
        proc = self._get(pid)
        if offset > proc.output_end:
            raise refusal("ValueError", f"offset {offset} is past the output's end")
        if offset == proc.output_end and proc.running and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.changed.wait(), wait_s)
        return proc.read(offset, max_bytes)

    def stdin(self, pid: int, data: bytes, eof: bool) -> int:
        proc = self._get(pid)
        if not proc.stdin_open:
            raise refusal("ValueError", f"process {pid} was started without stdin")
        if not proc.running:
            raise refusal("BrokenPipeError", f"process {pid} has exited")
        if data:
            proc.stdin.put_nowait(data)
        if eof:
            proc.stdin.put_nowait(None)
        return len(data)

    def signal(self, pid: int, sig: int | str) -> None:
        proc = self._get(pid)
        try:
            num = sig if isinstance(sig, int) else signals.Signals[
                sig if sig.startswith("SIG") else "SIG" + sig].value  # fmt: skip
        except KeyError:
            raise refusal("ValueError", f"unknown signal {sig!r}") from None
        if proc.running and proc.task is not None:
            proc.task.cancel()
            proc.end(128 + num)

    def resize(self, pid: int, cols: int, rows: int) -> None:
        proc = self._get(pid)
        if not proc.pty:
            raise refusal("ValueError", f"process {pid} has no terminal")
        proc.size = (cols, rows)
