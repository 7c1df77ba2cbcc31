"""Background processes in a sandbox: start, list, inspect, stream output, stdin, signals.

The guest agent owns the processes and a ring of each one's output
(docs/guest-agent.md, "Processes"); the daemon keeps nothing about them. An
output stream pulls from the agent one ``proc_read`` ahead of its consumer:
the next is asked for while the previous answer's events go out, and no
further until the consumer took them, so a client that stops reading stops
the pulling: the daemon holds two answers per stream at most, and each
stream is its own agent request, so one slow reader stalls no other process
or sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import ValidationError

from forkd import agent_wire as wire
from forkd.controller.models import (
    OutputEvent,
    ProcessInfo,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    ProcessStdin,
    StdinWritten,
)
from forkd.controller.services.activity import Activity
from forkd.controller.services.guest_calls import GuestCalls
from forkd.controller.services.process_output import OutputEvents, ReadAnswer
from forkd.controller.store import Store
from forkd.errors import ForkdError, GuestError, Invalid
from forkd.states import SandboxState

READ_BYTES = 256 << 10  # of output asked for by one proc_read while the reader keeps up
READ_BYTES_BEHIND = 1 << 20  # ... and once an answer came back full (the agent's cap)
# After an answer of BULK_BYTES or more, the next one waits up to BULK_LINGER_SECS
# for a full answer: a fast writer is carried in fewer, larger answers, while
# output that comes a line at a time is passed on at once.
BULK_BYTES = 64 << 10
BULK_LINGER_SECS = 0.02
FOLLOW_WAIT_SECS = 15.0  # one proc_read waits this long for output; then a keep-alive
QUICK_EMPTY_SECS = 0.05  # an empty answer sooner than this is paced: the agent should wait
PAUSED_POLL_SECS = 0.25  # a followed stream of a paused sandbox checks this often for resume

# Starting: a missing program or working directory is the request's fault.
_START_REFUSALS = {"FileNotFoundError": Invalid, "NotADirectoryError": Invalid}


def _info(raw: object) -> ProcessInfo:
    try:
        return ProcessInfo.model_validate(raw)
    except ValidationError as exc:
        raise GuestError(
            f"malformed process info from the agent: {exc.error_count()} errors"
        ) from exc


class ProcessService:
    def __init__(self, store: Store, activity: Activity, guest: GuestCalls) -> None:
        self.store = store
        self.activity = activity
        self.guest = guest

    async def start(self, sandbox_id: str, req: ProcessStart) -> ProcessInfo:
        pty: wire.PtySize | None = {"cols": req.pty.cols, "rows": req.pty.rows} if req.pty else None
        raw = await self.guest.call(
            sandbox_id,
            lambda vm: vm.guest.proc_start(
                req.cmd,
                env=req.env,
                cwd=req.cwd,
                stdin=req.stdin,
                pty=pty,
                timeout_s=req.timeout_s,
                user=req.user,
            ),
            _START_REFUSALS,
        )
        return _info(raw)

    async def list(self, sandbox_id: str) -> list[ProcessInfo]:
        raw = await self.guest.call(sandbox_id, lambda vm: vm.guest.proc_list())
        if not isinstance(raw, list):
            raise GuestError("malformed process list from the agent")
        return [_info(p) for p in raw]

    async def info(self, sandbox_id: str, pid: int) -> ProcessInfo:
        return _info(await self.guest.call(sandbox_id, lambda vm: vm.guest.proc_info(pid)))

    async def write_stdin(self, sandbox_id: str, pid: int, req: ProcessStdin) -> StdinWritten:
        if req.encoding == "base64":
            try:
                data = base64.b64decode(req.data, validate=True)
            except ValueError as exc:  # binascii.Error, or characters past ASCII
                raise Invalid(f"data is not base64: {exc}") from exc
        else:
            data = req.data.encode()
        written = await self.guest.call(
            sandbox_id, lambda vm: vm.guest.proc_stdin(pid, data, eof=req.eof)
        )
        return StdinWritten(written=written)

    async def signal(self, sandbox_id: str, pid: int, req: ProcessSignal) -> None:
        await self.guest.call(sandbox_id, lambda vm: vm.guest.proc_signal(pid, req.signal))

    async def resize(self, sandbox_id: str, pid: int, req: ProcessResize) -> None:
        await self.guest.call(sandbox_id, lambda vm: vm.guest.proc_resize(pid, req.cols, req.rows))

    # ------------------------------------------------------------ output

    async def output(
        self, sandbox_id: str, pid: int, offset: int, follow: bool
    ) -> AsyncIterator[OutputEvent]:
        """The events of ``pid``'s output from ``offset``: what is there now and, with
        ``follow``, what comes until it exits (``exit`` last).

        An unknown sandbox or process, or an offset past the output's end,
        raises here, before the first event.
        """
        info = await self.info(sandbox_id, pid)
        if offset > info.output_end:
            raise Invalid(f"offset {offset} is past the end of the output ({info.output_end})")
        return self._events(sandbox_id, pid, offset, None if follow else info.output_end)

    async def _events(
        self, sandbox_id: str, pid: int, offset: int, until: int | None
    ) -> AsyncIterator[OutputEvent]:
        """Pull and convert until the exit, or, when ``until`` is set, past ``until``.

        While one answer's events go out, the next ``proc_read`` is already
        asked for, so the guest encodes while the client reads; once an answer
        comes back full the reader is behind, and the next asks for more.
        A failure raises after the events read before it: the framing ends
        the stream with it (see :mod:`forkd.controller.sse`). A followed
        stream of a sandbox that is paused or hibernated waits, with keep-alives,
        until it is resumed, then goes on where it was.
        """
        events = OutputEvents()
        wait = FOLLOW_WAIT_SECS if until is None else 0.0
        want, linger = READ_BYTES, 0.0
        # The stream's first read wakes a paused sandbox (a request); its later ones wait
        # for it to be resumed by someone else, as a stream open across a pause does.
        pending: _PendingRead | None = self._ask(
            sandbox_id, pid, offset, wait, want, linger, wake=True
        )
        try:
            while True:
                assert pending is not None
                try:
                    answer = await pending.task
                except ForkdError:
                    if until is None and self.asleep_since(sandbox_id, pending.pauses):
                        async for event in self._while_paused(sandbox_id):
                            yield event
                        pending = self._ask(sandbox_id, pid, offset, wait, want, linger)
                        continue
                    for event in events.flush():  # what was read before the failure
                        yield event
                    raise
                asked, pending = pending.asked, None
                got = answer.next_offset - max(offset, answer.gap[1] if answer.gap else 0)
                progressed = answer.next_offset > offset or answer.gap is not None
                offset = answer.next_offset
                done = answer.eof or (until is not None and (offset >= until or not progressed))
                want = READ_BYTES_BEHIND if got >= want else READ_BYTES
                linger = BULK_LINGER_SECS if until is None and got >= BULK_BYTES else 0.0
                if progressed and not done:
                    pending = self._ask(sandbox_id, pid, offset, wait, want, linger)
                for event in events.of(answer):
                    yield event
                if done:
                    for event in events.flush():
                        yield event
                    return
                if not progressed:
                    yield OutputEvent("keepalive")
                    if time.monotonic() - asked < QUICK_EMPTY_SECS:
                        await asyncio.sleep(QUICK_EMPTY_SECS)
                    pending = self._ask(sandbox_id, pid, offset, wait, want, linger)
        finally:
            if pending is not None:
                pending.drop()

    def asleep(self, sandbox_id: str) -> bool:
        row = self.store.get_sandbox(sandbox_id)
        return row is not None and row.state in (SandboxState.PAUSED, SandboxState.HIBERNATED)

    def asleep_since(self, sandbox_id: str, pauses: int) -> bool:
        """Whether the sandbox is paused, or was since its pause count was ``pauses``
        (a read that ran out its time across a pause failed for it, not for good)."""
        return self.asleep(sandbox_id) or self.activity.pauses(sandbox_id) != pauses

    async def _while_paused(self, sandbox_id: str) -> AsyncIterator[OutputEvent]:
        """Until the sandbox is no longer paused: a keep-alive now and then."""
        quiet_since = time.monotonic()
        while self.asleep(sandbox_id):
            await asyncio.sleep(PAUSED_POLL_SECS)
            if time.monotonic() - quiet_since >= FOLLOW_WAIT_SECS:
                yield OutputEvent("keepalive")
                quiet_since = time.monotonic()

    def _ask(
        self,
        sandbox_id: str,
        pid: int,
        offset: int,
        wait: float,
        want: int,
        linger: float,
        wake: bool = False,
    ) -> _PendingRead:
        read = self._read(sandbox_id, pid, offset, wait, want, linger, wake)
        pauses = self.activity.pauses(sandbox_id)
        return _PendingRead(asyncio.ensure_future(read), time.monotonic(), pauses)

    async def _read(
        self,
        sandbox_id: str,
        pid: int,
        offset: int,
        wait: float,
        want: int,
        linger: float,
        wake: bool,
    ) -> ReadAnswer:
        raw = await self.guest.call(
            sandbox_id,
            lambda vm: vm.guest.proc_read(
                pid,
                offset,
                wait_s=wait,
                max_bytes=want,
                min_bytes=want if linger else 1,
                linger_s=linger,
            ),
            wake=wake,
        )
        return ReadAnswer.parse(raw, offset)


@dataclass(frozen=True)
class _PendingRead:
    """A ``proc_read`` asked for and not yet taken: ``asked`` is when."""

    task: asyncio.Future[ReadAnswer]
    asked: float
    pauses: int  # the sandbox's pause count when it was asked

    def drop(self) -> None:
        """The stream ended first: cancel it, and take any failure it had."""
        self.task.cancel()
        if self.task.done() and not self.task.cancelled():
            self.task.exception()
