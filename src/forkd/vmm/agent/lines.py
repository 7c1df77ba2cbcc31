"""The guest's byte stream cut into lines on the host, each kept or dropped by its head.

What :class:`forkd.vmm.agent.client.AgentClient` reads from a guest passes
through :class:`LineSplitter` (the guest is untrusted: a line no request waits
for streams past unbuffered and unparsed) and is paced by a
:class:`~forkd.token_bucket.TokenBucket`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PEEK_BYTES = 64  # an answer's id is within its first bytes
EVENT_LINE_MAX_BYTES = 128  # {"event":"started","pid":N}
MIN_PAUSE_SECS = 0.05  # a throttled reader sleeps at least this long: few wake-ups

# What the agent writes first on every answer line, and on its one event line.
_ANSWER_HEAD = re.compile(rb'\s*\{\s*"id"\s*:\s*(\d{1,20})\s*[,}]')
_EVENT_HEAD = re.compile(rb'\s*\{\s*"event"\s*:')
# An answer that says ``"raw":K`` second is followed, after its newline, by K raw
# bytes that belong to it (proc_read's output: no base64 for the guest to make).
_RAW_HEAD = re.compile(rb'\s*\{\s*"id"\s*:\s*\d{1,20}\s*,\s*"raw"\s*:\s*(\d{1,10})\s*[,}]')


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
