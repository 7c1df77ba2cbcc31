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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd import limits
from forkd.errors import AgentError

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 256 * 1024  # one read from the socket; also the reader's buffer limit
PEEK_BYTES = 64  # an answer's id is within its first bytes
EVENT_LINE_MAX_BYTES = 128  # {"event":"started","pid":N}
MIN_PAUSE_SECS = 0.05  # a throttled reader sleeps at least this long: few wake-ups
LINE_BURST_SECS = 0.1  # lines handled without a pause: 0.1 s of the rate, ~0.5 ms of work
ERROR_TEXT_MAX_CHARS = 4096  # of a guest's error message, kept for the caller and the log

# What the agent writes first on every answer line, and on its one event line.
_ANSWER_HEAD = re.compile(rb'\s*\{\s*"id"\s*:\s*(\d{1,20})\s*[,}]')
_EVENT_HEAD = re.compile(rb'\s*\{\s*"event"\s*:')
# An answer that says ``"raw":K`` second is followed, after its newline, by K raw
# bytes that belong to it (proc_read's output: no base64 for the guest to make).
_RAW_HEAD = re.compile(rb'\s*\{\s*"id"\s*:\s*\d{1,20}\s*,\s*"raw"\s*:\s*(\d{1,10})\s*[,}]')
RAW_OPS = frozenset({"proc_read", "file_read_range", "file_tar_read"})  # ask for raw bytes
# The one event there is, matched whole: no guest line is JSON-parsed unasked.
_STARTED = re.compile(rb'\s*\{\s*"event"\s*:\s*"started"\s*,\s*"pid"\s*:\s*(\d{1,10})\s*\}\s*')


def answer_cap(op: str) -> int:
    """The longest answer line accepted for a request of ``op``, in bytes."""
    if op == "file_read":
        return limits.AGENT_FILE_LINE_MAX_BYTES
    # proc_read fits the default: 1 MiB of output at most (342 KiB as forkd asks
    # for 256 KiB) as base64, plus ~64 bytes of JSON for each of at most 16384
    # chunks the agent's ring holds: under 2.5 MiB. proc_list: 128 commands' argv.
    if op == "eval":  # exec's streams plus the display outputs
        return limits.AGENT_EVAL_LINE_MAX_BYTES
    if op in ("exec", "file_list", "proc_list"):
        return limits.AGENT_OUTPUT_LINE_MAX_BYTES
    return limits.AGENT_LINE_MAX_BYTES


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up.

    :meth:`take` never refuses: it returns how long the taker should pause
    to pay back an overdraft (0 when there was enough).
    """

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self, n: float) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate) - n
        self._at = now
        if self._tokens >= 0:
            return 0.0
        return max(-self._tokens / self.rate, MIN_PAUSE_SECS)


@dataclass(frozen=True, slots=True)
class Line:
    """One line from the guest, or the notice that an answer outgrew its cap.

    ``data`` is None for a line dropped unread. ``req_id`` is the answer's id
    (None for an event or a dropped line).
    """

    req_id: int | None
    data: bytes | None
    overlong: bool = False
    raw: bytes | None = None  # the raw bytes that followed it, if its head announced some


class LineSplitter:
    """Splits the guest's byte stream into lines, deciding from each line's head
    whether to keep it.

    ``cap_for(req_id)`` is the longest answer accepted for a request still
    waiting, or None when no request with that id waits. Only kept lines are
    buffered, each up to its cap; everything else streams past. A line whose
    head announces raw bytes (``{"id":N,"raw":K,``) is followed by K bytes
    that are part of it, kept or skipped with it, and counted in its cap.
    """

    def __init__(self, cap_for: Callable[[int], int | None]) -> None:
        self._cap_for = cap_for
        self._buf = bytearray()
        self._raw = bytearray()
        self._raw_left = 0  # raw bytes still to come after the last line
        self._line: Line | None = None  # that line, given out once its raw bytes came
        self._reset()

    def _reset(self) -> None:
        self._buf.clear()
        self._decided = False
        self._keep = False
        self._cap = 0
        self._req_id: int | None = None
        self._raw_len = 0

    def feed(self, chunk: bytes) -> Iterator[Line]:
        view = memoryview(chunk)
        pos, size = 0, len(chunk)
        while pos < size:
            if self._raw_left:
                taken = min(self._raw_left, size - pos)
                if self._line is not None and self._line.data is not None:
                    self._raw += view[pos : pos + taken]
                self._raw_left -= taken
                pos += taken
                if not self._raw_left:
                    yield self._with_raw()
                continue
            nl = chunk.find(b"\n", pos)
            end = size if nl < 0 else nl
            if self._keep or not self._decided:
                self._buf += view[pos:end]
                if not self._decided:
                    self._decide(complete=nl >= 0)
                if self._keep and len(self._buf) + self._raw_len > self._cap:
                    if self._req_id is not None:  # fail its request now, not at the line's end
                        yield Line(self._req_id, None, overlong=True)
                    self._keep = False
                    self._buf.clear()
            if nl < 0:
                return
            raw_len = self._raw_len
            line = self._finish()
            pos = nl + 1
            if raw_len:
                self._line, self._raw_left = line, raw_len
            else:
                yield line

    def _decide(self, complete: bool) -> None:
        head = bytes(self._buf[:PEEK_BYTES])
        if not complete and len(head) < PEEK_BYTES:
            return  # too little yet to tell, or to read a "raw" count
        if raw := _RAW_HEAD.match(head):
            self._raw_len = int(raw[1])  # skipped with the line if it is not kept
        if m := _ANSWER_HEAD.match(head):
            self._req_id = int(m[1])
            cap = self._cap_for(self._req_id)
            self._keep, self._cap = cap is not None, cap or 0
        elif _EVENT_HEAD.match(head):
            self._keep, self._cap = True, EVENT_LINE_MAX_BYTES
        self._decided = True
        if not self._keep:
            self._buf.clear()

    def _finish(self) -> Line:
        line = Line(self._req_id, bytes(self._buf)) if self._keep else Line(None, None)
        self._reset()
        return line

    def _with_raw(self) -> Line:
        line, self._line = self._line, None
        assert line is not None
        if line.data is not None:
            line = Line(line.req_id, line.data, raw=bytes(self._raw))
        self._raw.clear()
        return line


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
        self._closed_reason: str | None = None
        # Per VM, across reconnects: what the guest may make the daemon read.
        lines = limits.AGENT_READ_LINES_PER_SEC
        self._lines = TokenBucket(lines, max(1.0, lines * LINE_BURST_SECS))
        self._bytes = TokenBucket(limits.AGENT_READ_BYTES_PER_SEC, limits.AGENT_READ_BYTES_PER_SEC)
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
        params: dict[str, Any] | None = None,
        *,
        wait: float = 30.0,
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
        line = json.dumps({**head, **(params or {}), **head, "op": op}).encode() + b"\n"
        try:
            await self._send([line] if payload is None else [line, payload], op, wait)
            msg = await asyncio.wait_for(fut, wait)
        except TimeoutError as exc:
            raise AgentError(f"agent did not answer {op!r} within {wait:g} s") from exc
        finally:
            self._pending.pop(req_id, None)
            if not fut.done():  # sending failed: no answer is awaited any more
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # an abort's error, already raised by sending
        if not msg["ok"]:
            error = _short(msg.get("error") or f"agent {op} failed")
            raise AgentError(error, kind=msg.get("kind"))
        return msg.get("result") or {}

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
