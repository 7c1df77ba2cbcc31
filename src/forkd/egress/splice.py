"""Bytes moved both ways between a guest's connection and its upstream, until both
sides are done or neither has said anything for ``idle`` seconds."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

CHUNK = 256 * 1024
IDLE_SECS = 300.0  # a connection on which neither side sent a byte this long is closed


@dataclass
class Counts:
    out: int = 0  # guest -> upstream
    into: int = 0  # upstream -> guest
    last: float = field(default_factory=time.monotonic)


async def _pipe(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, counts: Counts, outward: bool,
    idle: float,
) -> None:  # fmt: skip
    while True:
        try:
            data = await asyncio.wait_for(src.read(CHUNK), idle)
        except TimeoutError:
            if time.monotonic() - counts.last < idle:  # the other way is busy
                continue
            raise
        if not data:
            break
        counts.last = time.monotonic()
        if outward:
            counts.out += len(data)
        else:
            counts.into += len(data)
        dst.write(data)
        await asyncio.wait_for(dst.drain(), idle)  # a peer that stops reading: cut
    if dst.can_write_eof():
        with contextlib.suppress(OSError):
            dst.write_eof()


async def splice(
    guest: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    counts: Counts,
    idle: float = IDLE_SECS,
) -> str | None:
    """Move bytes until both directions end; returns why it ended early, or None."""
    outward = asyncio.ensure_future(_pipe(guest[0], upstream[1], counts, True, idle))
    inward = asyncio.ensure_future(_pipe(upstream[0], guest[1], counts, False, idle))
    try:
        done, pending = await asyncio.wait({outward, inward}, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:  # one side failed: the other is cut
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if (exc := task.exception()) is not None:
                if isinstance(exc, TimeoutError):
                    return f"idle for {idle:.0f} s"
                return f"{type(exc).__name__}: {exc}"
        return None
    finally:
        for task in (outward, inward):
            task.cancel()


CLOSE_SECS = 5.0  # what a closed connection may still take to send its last bytes


def close_soon(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``, and abort it if its last bytes have not gone in CLOSE_SECS: a
    peer that never reads (a zero window) must not keep a socket, and with it a
    namespace, alive."""
    writer.close()
    transport = writer.transport
    if not transport.is_closing() or transport.get_write_buffer_size():
        asyncio.get_running_loop().call_later(CLOSE_SECS, transport.abort)
