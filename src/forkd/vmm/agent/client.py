"""Host side of the guest agent channel (newline-delimited JSON, see docs/guest-agent.md).

One connection per VM over QEMU's unix socket for the virtio-serial port.
Requests carry ids, so many can be in flight; answers are matched by id.

The guest is untrusted, so nothing it does may wedge or slow the daemon:

- every write is bounded: a guest that stops reading for
  ``AGENT_WRITE_STALL_SECS`` gets its connection aborted, which fails the
  requests in flight with :class:`AgentError`; :meth:`AgentClient.close`
  aborts instead of flushing;
- a line is classified from its first bytes, before any JSON parse: the agent
  writes ``{"id":<int>,`` first, so a line whose id no request is waiting for
  (a stale answer, a flood, garbage) is dropped as it streams past, unbuffered
  and unparsed; raw bytes a line announces (``{"id":N,"raw":K,``) go with it,
  and are never read as lines;
- an answer may be only as long as its op can legitimately make it
  (:func:`answer_cap`); a longer one fails its request at once;
- reading is rate-limited per VM, in lines and bytes (:class:`TokenBucket`):
  past the rate the reader pauses, so the guest's own writes block;
- malformed JSON, invalid UTF-8 or nesting too deep for the parser fails
  only the request it claims to answer; the reader never dies of a line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd import limits
from forkd.errors import AgentError
from forkd.token_bucket import TokenBucket
from forkd.vmm.agent.lines import MIN_PAUSE_SECS, Line, LineSplitter

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 256 * 1024  # one read from the socket; also the reader's buffer limit
LINE_BURST_SECS = 0.1  # lines handled without a pause: 0.1 s of the rate, ~0.5 ms of work
ANSWER_WAIT_SECS = 30.0  # for an op's answer, unless its caller says how long
ERROR_TEXT_MAX_CHARS = 4096  # of a guest's error message, kept for the caller and the log

RAW_OPS = frozenset({"proc_read", "file_read_range", "file_tar_read"})  # ask for raw bytes
SMALL_ANSWER_OPS = frozenset(
    {
        "ping",
        "restore",
        "configure",
        "proc_signal",
        "proc_resize",
        "eval_interrupt",
        "file_remove",
        "file_transfer_abort",
    }
)
# The one event there is, matched whole: no guest line is JSON-parsed unasked.
_STARTED = re.compile(rb'\s*\{\s*"event"\s*:\s*"started"\s*,\s*"pid"\s*:\s*(\d{1,10})\s*\}\s*')


def answer_cap(op: str) -> int:
    """The longest answer line accepted for a request of ``op``, in bytes."""
    if op == "file_read":
        return limits.AGENT_FILE_LINE_MAX_BYTES
    # proc_read fits the default: 1 MiB of output at most (342 KiB as forkd asks
    # for 256 KiB) as base64, plus ~64 bytes of JSON for each of at most 16384
    # chunks the agent's ring holds: under 2.5 MiB.
    if op == "eval":  # exec's streams plus the display outputs
        return limits.AGENT_EVAL_LINE_MAX_BYTES
    if op in ("exec", "file_list", "fs_list"):
        return limits.AGENT_OUTPUT_LINE_MAX_BYTES
    if op == "proc_list":
        return limits.AGENT_LISTING_LINE_MAX_BYTES
    if op == "stats":  # asked of every guest while someone watches: kept small
        return limits.AGENT_STATS_LINE_MAX_BYTES
    if op in SMALL_ANSWER_OPS:
        return limits.AGENT_SMALL_LINE_MAX_BYTES
    return limits.AGENT_LINE_MAX_BYTES


@dataclass
class _Pending:
    op: str
    fut: asyncio.Future[dict[str, Any]]


def _answer_problem(msg: Any, req_id: int) -> str | None:
    """What is wrong with ``msg`` as the answer to ``req_id``; None if nothing."""
    if not isinstance(msg, dict):
        return "not a JSON object"
    if type(msg.get("id")) is not int or msg["id"] != req_id:
        return "its id does not match"
    ok = msg.get("ok")
    if not isinstance(ok, bool):
        return "'ok' is not true or false"
    if ok and not isinstance(msg.get("result", {}), dict | None):
        return "'result' is not an object"
    if not ok and not all(isinstance(msg.get(k), str | None) for k in ("error", "kind")):
        return "'error' or 'kind' is not a string"
    return None


def _short(text: str) -> str:
    return text if len(text) <= ERROR_TEXT_MAX_CHARS else text[:ERROR_TEXT_MAX_CHARS] + "..."


class AgentClient:
    def __init__(self, sock_path: Path) -> None:
        self.sock_path = sock_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, _Pending] = {}
        # Random start: an answer to a request made before a snapshot may reach a
        # restored VM's new connection, and must not match a new request's id.
        self._ids = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._read_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._held = False  # by hold(): no request is sent until release()
        self._payloads_in_flight = 0  # sent, their answers not come: the guest may still read
        self._payloads_done = asyncio.Event()
        self._payloads_done.set()
        self._closed_reason: str | None = None
        # Per VM, across reconnects: what the guest may make the daemon read.
        lines = limits.AGENT_READ_LINES_PER_SEC
        self._lines = TokenBucket(
            lines, max(1.0, lines * LINE_BURST_SECS), min_pause=MIN_PAUSE_SECS
        )
        self._bytes = TokenBucket(
            limits.AGENT_READ_BYTES_PER_SEC,
            limits.AGENT_READ_BYTES_PER_SEC,
            min_pause=MIN_PAUSE_SECS,
        )
        self.dropped_lines = 0  # unsolicited, broken or over their cap: dropped unparsed

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._closed_reason is None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to QEMU's socket for the port (it exists once QEMU started)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.sock_path), limit=READ_CHUNK_BYTES
                )
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise AgentError(f"cannot connect to {self.sock_path}: {exc}") from exc
                await asyncio.sleep(0.005)
        self._closed_reason = None
        self._read_task = asyncio.create_task(
            self._read_loop(self._reader, self._writer), name="forkd-agent-reader"
        )
        # A lone newline ends any partial line a snapshot may have left in the guest.
        async with self._write_lock:
            self._writer.write(b"\n")
            await self._drain(self._writer, "connect")

    # ------------------------------------------------------------ reading

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason = "agent connection closed"
        splitter = LineSplitter(self._answer_cap)
        try:
            while chunk := await reader.read(READ_CHUNK_BYTES):
                pause = self._bytes.take(len(chunk))
                for line in splitter.feed(chunk):
                    self._handle(line)
                    if line_pause := self._lines.take(1):
                        await asyncio.sleep(line_pause)
                if pause:
                    await asyncio.sleep(pause)
        except ConnectionError as exc:
            reason = f"agent connection broken: {exc}"
        finally:
            if self._writer is writer:
                self._closed_reason = self._closed_reason or reason
                self._fail_pending(self._closed_reason)

    def _answer_cap(self, req_id: int) -> int | None:
        pending = self._pending.get(req_id)
        if pending is None or pending.fut.done():
            return None
        return answer_cap(pending.op)

    def _handle(self, line: Line) -> None:
        try:
            if line.overlong and line.req_id is not None:
                self._overlong(line.req_id)
            elif line.data is None:
                self._dropped()
            elif line.req_id is None:
                self._event(line.data)
            else:
                self._answer(line.req_id, line.data, line.raw)
        except Exception:  # a bug here must not stop the reader
            log.exception("agent line not handled")

    def _dropped(self) -> None:
        self.dropped_lines += 1
        if self.dropped_lines == 1:
            log.info("%s: dropping agent lines no request waits for", self.sock_path)

    def _overlong(self, req_id: int) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None and not pending.fut.done():
            cap = answer_cap(pending.op)
            pending.fut.set_exception(
                AgentError(f"the agent's answer to {pending.op!r} is longer than {cap} bytes")
            )

    def _event(self, data: bytes) -> None:
        started = _STARTED.fullmatch(data)
        if started is None:
            self._dropped()
            return
        self._fail_pending(
            f"the guest agent restarted (pid {int(started.group(1))}); requests "
            "in flight were lost (did code run by eval crash the interpreter?)"
        )

    def _answer(self, req_id: int, data: bytes, raw: bytes | None) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None or pending.fut.done():
            self._dropped()
            return
        try:
            msg = json.loads(data)
        except Exception as exc:  # ValueError, UnicodeDecodeError, RecursionError
            problem: str | None = f"not JSON ({type(exc).__name__})"
        else:
            problem = _answer_problem(msg, req_id)
        if problem is None and raw is not None:
            if pending.op not in RAW_OPS or not isinstance(msg.get("result"), dict):
                problem = "raw bytes where none were asked for"
            else:
                msg["result"]["raw"] = raw
        if problem is not None:
            pending.fut.set_exception(
                AgentError(f"malformed answer from the agent to {pending.op!r}: {problem}")
            )
        else:
            pending.fut.set_result(msg)

    def _fail_pending(self, reason: str) -> None:
        for pending in self._pending.values():
            if not pending.fut.done():
                pending.fut.set_exception(AgentError(reason))
        self._pending.clear()

    # ------------------------------------------------------------ writing

    async def _drain(self, writer: asyncio.StreamWriter, op: str) -> None:
        """Wait until the guest took the data; abort if it stops taking it."""
        stall = limits.AGENT_WRITE_STALL_SECS
        while True:
            before = writer.transport.get_write_buffer_size()
            try:
                await asyncio.wait_for(writer.drain(), stall)
                return
            except TimeoutError:
                if writer.transport.get_write_buffer_size() < before:
                    continue  # slow, but the guest is reading
                reason = (
                    f"the guest stopped reading: sending {op!r} made no progress in {stall:g} s"
                )
                self.abort(reason)
                raise AgentError(reason) from None
            except ConnectionError as exc:
                raise AgentError(self._closed_reason or f"agent connection broken: {exc}") from exc

    async def _send(self, data: list[bytes], op: str, wait: float) -> None:
        try:
            await asyncio.wait_for(self._write_lock.acquire(), wait)
        except TimeoutError:
            raise AgentError(
                f"could not send {op!r} within {wait:g} s: the agent channel is busy"
            ) from None
        try:
            writer = self._open_writer()
            writer.writelines(data)
            await self._drain(writer, op)
        finally:
            self._write_lock.release()

    def _open_writer(self) -> asyncio.StreamWriter:
        if self._writer is None or self._closed_reason is not None:
            raise AgentError(self._closed_reason or "agent not connected")
        return self._writer

    async def call(
        self,
        op: str,
        params: Mapping[str, object] | None = None,
        *,
        wait: float = ANSWER_WAIT_SECS,
        payload: bytes | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait up to ``wait`` seconds for its ``result``.

        ``payload`` is sent raw after the request's line, announced by its head
        (``{"id":N,"payload":K,``); only an agent that said it reads payloads may
        be sent one, as an older one would read the bytes as request lines.

        Sending is bounded too: by ``wait`` for the channel to be free, and by
        ``AGENT_WRITE_STALL_SECS`` of no progress once writing.
        """
        self._open_writer()
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = _Pending(op, fut)
        head: dict[str, Any] = {"id": req_id}
        if payload is not None:
            head["payload"] = len(payload)
        elif params and "payload" in params:
            raise ValueError("'payload' is the framing's key, not a parameter")
        line = json.dumps({**head, **(params or {}), **head, "op": op}).encode() + b"\n"
        if payload is not None:
            self._payloads_in_flight += 1
            self._payloads_done.clear()
        try:
            await self._send([line] if payload is None else [line, payload], op, wait)
            msg = await asyncio.wait_for(fut, wait)
        except TimeoutError as exc:
            raise AgentError(f"agent did not answer {op!r} within {wait:g} s") from exc
        finally:
            if payload is not None:
                self._payloads_in_flight -= 1
                if not self._payloads_in_flight:
                    self._payloads_done.set()
            self._pending.pop(req_id, None)
            if not fut.done():  # sending failed: no answer is awaited any more
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # an abort's error, already raised by sending
        if not msg["ok"]:
            error = _short(msg.get("error") or f"agent {op} failed")
            raise AgentError(error, kind=msg.get("kind"))
        return msg.get("result") or {}

    # ------------------------------------------------------------ holding

    async def hold(self, wait: float) -> None:
        """Stop sending until :meth:`release`: for a pause or a snapshot of the VM.

        Waits until no request is half sent (a stopped guest would never take
        the rest, and the stalled write would abort the channel) and no payload
        is still being read by the guest (a snapshot would leave the guest
        waiting for the rest of it, taking what its forks are sent as payload
        bytes). :class:`AgentError` when that takes over ``wait`` seconds;
        nothing is held then.
        """
        if self._writer is None or self._closed_reason is not None:
            return  # nothing can be sent anyway
        try:
            await asyncio.wait_for(self._write_lock.acquire(), wait)
        except TimeoutError:
            raise AgentError(
                f"a request to the agent is still being sent after {wait:g} s"
            ) from None
        try:
            await asyncio.wait_for(self._payloads_done.wait(), wait)
        except TimeoutError:
            self._write_lock.release()
            raise AgentError(
                f"an upload to the guest is still being read after {wait:g} s"
            ) from None
        self._held = True

    def release(self) -> None:
        """Let requests be sent again after :meth:`hold` (nothing when not held)."""
        if self._held:
            self._held = False
            self._write_lock.release()

    # ------------------------------------------------------------ closing

    def abort(self, reason: str) -> None:
        """Drop the connection now, unsent data and all; requests in flight fail."""
        self._closed_reason = self._closed_reason or reason
        self._fail_pending(self._closed_reason)
        if self._writer is not None:
            self._writer.transport.abort()

    async def close(self) -> None:
        """Close without waiting on the guest: unsent data is dropped, not flushed.

        Nobody is left to read an answer on a connection being closed, and a
        flush would wait forever on a guest that stopped reading.
        """
        self.abort("agent connection closed")
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._read_task, limits.AGENT_CLOSE_SECS)
        self._writer = None
        self._reader = None
