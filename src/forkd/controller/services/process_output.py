"""The events of a process's output stream, made from the agent's ``proc_read`` answers.

The agent keeps one sequence of bytes per process, stdout, stderr and pty
chunks interleaved, each byte at a global offset (docs/guest-agent.md). Here
adjacent chunks of one stream become one event; text that is valid UTF-8 is
sent as text, anything else as base64, and so is text made mostly of control
characters that JSON would escape to six times their size (NUL bytes). A
character cut in two at a chunk's end is held back until the rest of it
arrives, so it is not sent as base64 halves. Every event says where the
next one starts (``next_offset``), which is where a client that reconnects
resumes.
"""

from __future__ import annotations

import base64
import binascii
import codecs
from dataclasses import dataclass
from typing import Literal

from forkd import agent_wire as wire
from forkd.controller.models import OutputData, OutputEvent, OutputExit, OutputGap
from forkd.errors import GuestError

Stream = Literal["stdout", "stderr", "pty"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr", "pty")
# The chunks one answer may hold: the agent's ring holds no more. Each becomes an event
# at worst; a guest sending more would have the loop make them all.
MAX_CHUNKS = wire.RING_MAX_CHUNKS
# The bytes JSON escapes as \u00XX, six characters each (\t, \n, \r take two).
_ESCAPED_LONG = bytes(b for b in range(32) if b not in b"\t\n\r")
_NOT_ESCAPED_LONG = bytes(b for b in range(256) if b not in _ESCAPED_LONG)


@dataclass(frozen=True)
class Chunk:
    stream: Stream
    offset: int
    data: bytes


@dataclass(frozen=True)
class ReadAnswer:
    """One ``proc_read`` answer, checked: the guest is not trusted to send what it should."""

    chunks: list[Chunk]
    next_offset: int
    gap: tuple[int, int] | None
    exit_code: int | None
    eof: bool

    @classmethod
    def parse(cls, raw: wire.ProcReadAnswer, offset: int) -> ReadAnswer:
        try:
            if len(raw["chunks"]) > MAX_CHUNKS:
                raise ValueError(f"more than {MAX_CHUNKS} chunks")
            tail = raw.get("raw")  # the bytes themselves, when the agent sent them raw
            chunks = [_chunk(c) for c in raw["chunks"]] if tail is None else _sized(raw, tail)
            _in_order(chunks)
            gap = raw.get("gap")
            answer = cls(
                chunks=chunks,
                next_offset=_int(raw["next_offset"]),
                gap=(_int(gap["from"]), _int(gap["to"])) if gap is not None else None,
                exit_code=None if raw.get("exit_code") is None else _int(raw["exit_code"]),
                eof=raw["eof"] is True,
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise GuestError(f"malformed proc_read answer from the agent: {exc!r}") from exc
        if answer.next_offset < offset:
            raise GuestError(f"the agent's output went back from {offset} to {answer.next_offset}")
        return answer


def _in_order(chunks: list[Chunk]) -> None:
    """ValueError unless each chunk starts at or after the end of the one before: the
    agent's output is one sequence of bytes, never told twice in one answer."""
    end = 0
    for chunk in chunks:
        if chunk.offset < end:
            raise ValueError(f"a chunk at {chunk.offset} overlaps the one before, ending at {end}")
        end = chunk.offset + len(chunk.data)


def _int(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"not an offset or exit code: {value!r}")
    return value


def _stream(name: object) -> Stream:
    for stream in STREAMS:
        if name == stream:
            return stream
    raise ValueError(f"unknown stream {name!r}")


def _chunk(raw: wire.OutputChunk) -> Chunk:
    stream = _stream(raw["stream"])
    data = base64.b64decode(raw["data"], validate=True)
    return Chunk(stream, _int(raw["offset"]), data)


def _sized(raw: wire.ProcReadAnswer, tail: object) -> list[Chunk]:
    """Chunks that give their ``size``, cut from the raw bytes after the answer."""
    if not isinstance(tail, bytes):
        raise TypeError("raw output is not bytes")
    chunks, pos = [], 0
    for c in raw["chunks"]:
        stream = _stream(c["stream"])
        size = _int(c["size"])
        chunks.append(Chunk(stream, _int(c["offset"]), tail[pos : pos + size]))
        pos += size
    if pos != len(tail):
        raise ValueError(f"the chunks hold {pos} bytes, the raw output {len(tail)}")
    return chunks


def _runs(chunks: list[Chunk]) -> list[Chunk]:
    """``chunks`` with each run of adjacent chunks of one stream joined."""
    groups: list[list[Chunk]] = []
    for chunk in chunks:
        last = groups[-1][-1] if groups else None
        if last and last.stream == chunk.stream and last.offset + len(last.data) == chunk.offset:
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return [
        g[0] if len(g) == 1 else Chunk(g[0].stream, g[0].offset, b"".join(c.data for c in g))
        for g in groups
    ]


def _escapes_long(data: bytes) -> bool:
    """Whether ``data`` is shorter as base64 than as a JSON string: it is mostly
    control characters (a NUL is the usual one; it is looked for first, cheaply)."""
    if b"\0" not in data:
        return False
    escaped = len(data.translate(None, _NOT_ESCAPED_LONG))
    return escaped * 5 > len(data) // 3  # 5 extra characters each, base64 adds a third


def _data_event(stream: Stream, offset: int, data: bytes, text: str | None) -> OutputEvent:
    end = offset + len(data)
    body = OutputData(
        data=text if text is not None else base64.b64encode(data).decode(),
        encoding="utf-8" if text is not None else "base64",
        offset=offset,
        next_offset=end,
    )
    return OutputEvent(stream, body, next_offset=end)


class OutputEvents:
    """Turns successive ``proc_read`` answers of one stream into its events."""

    def __init__(self) -> None:
        self._held: Chunk | None = None  # the start of a character cut at a chunk's end

    def of(self, answer: ReadAnswer) -> list[OutputEvent]:
        """The events of ``answer``; the ``exit`` event last when it is the end."""
        events: list[OutputEvent] = []
        if answer.gap is not None:
            events += self.flush()
            lost_from, lost_to = answer.gap
            gap = OutputGap(from_offset=lost_from, to=lost_to)
            events.append(OutputEvent("gap", gap, next_offset=lost_to))
        for run in _runs(answer.chunks):
            held = self._held
            if held and held.stream == run.stream and held.offset + len(held.data) == run.offset:
                run = Chunk(run.stream, held.offset, held.data + run.data)
                self._held = None
            else:
                events += self.flush()
            events += self._decoded(run)
        if answer.eof:
            events += self.flush()
            events.append(OutputEvent("exit", OutputExit(exit_code=answer.exit_code)))
        return events

    def _decoded(self, run: Chunk) -> list[OutputEvent]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            text = decoder.decode(run.data, final=False)
        except UnicodeDecodeError:
            return [_data_event(run.stream, run.offset, run.data, None)]
        tail = decoder.getstate()[0]
        whole = run.data[: len(run.data) - len(tail)]
        if tail:
            self._held = Chunk(run.stream, run.offset + len(whole), tail)
        if not whole:
            return []
        return [_data_event(run.stream, run.offset, whole, None if _escapes_long(whole) else text)]

    def flush(self) -> list[OutputEvent]:
        """The bytes held back, as base64: what follows them will not complete them."""
        held, self._held = self._held, None
        return [_data_event(held.stream, held.offset, held.data, None)] if held else []
