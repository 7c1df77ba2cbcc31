"""A background process's terminal as raw bytes: its output from an offset, keystrokes in.

The processes service streams output as events for Server-Sent Events; a
terminal wants the bytes themselves, both ways (the ``/pty`` WebSocket,
docs/API.md). Output is pulled from the agent one ``proc_read`` at a time
and the next is asked for only once the consumer took the previous piece,
so a client that stops reading stops the pulling: the daemon holds one
answer (at most ``READ_BYTES``) per terminal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from forkd.controller.models import ProcessInfo
from forkd.controller.services.process_output import ReadAnswer
from forkd.controller.services.processes import (
    BULK_LINGER_SECS,
    FOLLOW_WAIT_SECS,
    PAUSED_POLL_SECS,
    QUICK_EMPTY_SECS,
    READ_BYTES,
    ProcessService,
)
from forkd.errors import ForkdError, Invalid

# After an answer of BULK_BYTES or more, the next waits up to BULK_LINGER_SECS to
# fill: a flood (cat of a big file) goes in fewer, larger frames, while an echo
# or a prompt goes at once. Lower than the output stream's 64 KiB: a terminal
# flooding under TCG gave answers of 32-40 KiB without lingering (5-6 MiB/s),
# and full 256 KiB ones with it (7-9 MiB/s).
BULK_BYTES = 16 << 10


@dataclass(frozen=True)
class TerminalBytes:
    """Output bytes, ``data``, that start at ``offset``."""

    data: bytes
    offset: int


@dataclass(frozen=True)
class TerminalGap:
    """Output from ``lost_from`` to ``lost_to`` left the guest's ring before it was read."""

    lost_from: int
    lost_to: int


@dataclass(frozen=True)
class TerminalExit:
    """The process ended and all its output was given; the last piece."""

    exit_code: int | None


TerminalPiece = TerminalBytes | TerminalGap | TerminalExit


class TerminalService:
    """Opens the terminal of a process started with ``pty``; writes to it and resizes it."""

    def __init__(self, processes: ProcessService) -> None:
        self.processes = processes

    async def open(self, sandbox_id: str, pid: int, offset: int) -> AsyncIterator[TerminalPiece]:
        """The terminal's output from ``offset`` until the process exits (the exit last).

        An unknown sandbox or process, a process without a terminal, or an
        offset past the output's end raises here, before the first piece.
        """
        info = await self.processes.info(sandbox_id, pid)
        check_terminal(info, offset)
        return self._pieces(sandbox_id, pid, offset)

    async def _pieces(self, sandbox_id: str, pid: int, offset: int) -> AsyncIterator[TerminalPiece]:
        linger = 0.0
        while True:
            asked = time.monotonic()
            answer = await self._read(sandbox_id, pid, offset, linger)
            if answer.gap is not None:
                yield TerminalGap(*answer.gap)
            data = b"".join(chunk.data for chunk in answer.chunks)  # one frame, not one a read
            if data:
                yield TerminalBytes(data, answer.chunks[0].offset)
            if answer.eof:
                yield TerminalExit(answer.exit_code)
                return
            progressed = answer.next_offset > offset or answer.gap is not None
            offset = answer.next_offset
            linger = BULK_LINGER_SECS if len(data) >= BULK_BYTES else 0.0
            if not progressed and time.monotonic() - asked < QUICK_EMPTY_SECS:
                await asyncio.sleep(QUICK_EMPTY_SECS)  # the agent should have waited

    async def _read(self, sandbox_id: str, pid: int, offset: int, linger: float) -> ReadAnswer:
        """The next piece of output. Reading does not wake the sandbox: a terminal open
        across a pause or a hibernation waits for it to run again (its keystrokes, a
        request, or a resume wake it), and a read that a pause cut short is asked again."""
        processes = self.processes
        while True:
            while processes.asleep(sandbox_id):
                await asyncio.sleep(PAUSED_POLL_SECS)
            pauses = processes.activity.pauses(sandbox_id)
            try:
                raw = await processes.guest.call(
                    sandbox_id,
                    lambda vm: vm.guest.proc_read(
                        pid,
                        offset,
                        wait_s=FOLLOW_WAIT_SECS,
                        max_bytes=READ_BYTES,
                        min_bytes=READ_BYTES if linger else 1,
                        linger_s=linger,
                    ),
                    wake=False,
                )
            except ForkdError:
                if not processes.asleep_since(sandbox_id, pauses):
                    raise
                continue
            return ReadAnswer.parse(raw, offset)

    async def write(self, sandbox_id: str, pid: int, data: bytes) -> None:
        """Keystrokes: ``data`` to the terminal's input."""
        await self.processes.guest.call(sandbox_id, lambda vm: vm.guest.proc_stdin(pid, data))

    async def resize(self, sandbox_id: str, pid: int, cols: int, rows: int) -> None:
        await self.processes.guest.call(
            sandbox_id, lambda vm: vm.guest.proc_resize(pid, cols, rows)
        )


def check_terminal(info: ProcessInfo, offset: int) -> None:
    """Invalid unless ``info`` has a terminal and ``offset`` is not past its output's end."""
    if not info.pty:
        raise Invalid(f"process {info.pid} has no terminal: start it with pty={{cols, rows}}")
    if offset > info.output_end:
        raise Invalid(f"offset {offset} is past the end of the output ({info.output_end})")
