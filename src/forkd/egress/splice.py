"""Bytes moved both ways between a guest's connection and its upstream, until both
sides are done or neither has said anything for ``idle`` seconds.

Each chunk is read only once the sandbox's :class:`~.meter.Meter` grants room for
it, and is given back once the other side's socket took it: what a sandbox's
connections hold in the daemon is bounded by its share, not by how many it opens.
Connections passed through whole (TLS by name, raw TCP) are spliced socket to
socket, with no buffer of the event loop's between them; a connection served as
HTTP (:mod:`.http`) and switched to another protocol is spliced stream to stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from forkd.egress.meter import Meter

CHUNK = 256 * 1024
IDLE_SECS = 300.0  # a connection on which neither side sent a byte this long is closed
CLOSE_SECS = 5.0  # what a closed connection may still take to send its last bytes

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Counts:
    out: int = 0  # guest -> upstream
    into: int = 0  # upstream -> guest
    last: float = field(default_factory=time.monotonic)

    def add(self, n: int, outward: bool) -> None:
        self.last = time.monotonic()
        if outward:
            self.out += n
        else:
            self.into += n


async def carry(
    data: bytes,
    dst: asyncio.StreamWriter,
    counts: Counts,
    meter: Meter,
    outward: bool,
    idle: float,
    counted: int | None = None,
) -> None:
    """``data``, already in hand, on to ``dst`` within the sandbox's share and at its
    rate; counted as ``counted`` bytes when it holds framing of the proxy's own."""
    held = await meter.hold(len(data))
    try:
        counts.add(len(data) if counted is None else counted, outward)
        await meter.pace(len(data), outward)
        dst.write(data)
        await asyncio.wait_for(dst.drain(), idle)  # a peer that stops reading: cut
    finally:
        meter.give(held)


async def _socket_pipe(
    src: socket.socket, dst: socket.socket, counts: Counts, meter: Meter, outward: bool, idle: float
) -> None:
    """Read what is there, as much as the share has room for; with nothing there, wait
    for more holding none of the share (a connection waiting for its peer holds none)."""
    loop = asyncio.get_running_loop()
    while True:
        granted = await meter.grant(CHUNK)
        try:
            data = src.recv(granted)
        except BlockingIOError:
            meter.give(granted)
            if not await readable(src, idle) and time.monotonic() - counts.last >= idle:
                raise TimeoutError from None  # (else the other way is busy: wait on)
            continue
        except BaseException:
            meter.give(granted)
            raise
        try:
            if not data:
                break
            counts.add(len(data), outward)
            await meter.pace(len(data), outward)
            await asyncio.wait_for(loop.sock_sendall(dst, data), idle)  # a peer not reading: cut
        finally:
            meter.give(granted)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


async def _stream_pipe(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    counts: Counts,
    meter: Meter,
    outward: bool,
    idle: float,
) -> None:
    """As :func:`_socket_pipe`; a chunk is read from the stream's buffer (bounded by
    its limit) before the share is asked for it."""
    while True:
        try:
            data = await asyncio.wait_for(src.read(CHUNK), idle)
        except TimeoutError:
            if time.monotonic() - counts.last < idle:
                continue
            raise
        if not data:
            break
        await carry(data, dst, counts, meter, outward, idle)
    if dst.can_write_eof():
        with contextlib.suppress(OSError):
            dst.write_eof()


async def _both(outward: Awaitable[None], inward: Awaitable[None], idle: float) -> str | None:
    """Run both directions until both end; why it ended early, or None."""
    tasks = (asyncio.ensure_future(outward), asyncio.ensure_future(inward))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if (exc := task.exception()) is not None:
                if isinstance(exc, TimeoutError):
                    return f"idle for {idle:.0f} s"
                return f"{type(exc).__name__}: {exc}"
        return None
    finally:  # one side failed: the other is cut; both end before the sockets may be
        for task in tasks:  # closed (or their numbers reused while the loop watches them)
            task.cancel()
        await asyncio.wait(tasks)


def splice(
    guest: Stream, upstream: Stream, counts: Counts, meter: Meter, idle: float = IDLE_SECS
) -> Awaitable[str | None]:
    """Move bytes between two streams until both directions end."""
    return _both(
        _stream_pipe(guest[0], upstream[1], counts, meter, True, idle),
        _stream_pipe(upstream[0], guest[1], counts, meter, False, idle),
        idle,
    )


def splice_sockets(
    guest: socket.socket,
    upstream: socket.socket,
    counts: Counts,
    meter: Meter,
    idle: float = IDLE_SECS,
) -> Awaitable[str | None]:
    """Move bytes between two connected non-blocking sockets until both directions end."""
    return _both(
        _socket_pipe(guest, upstream, counts, meter, True, idle),
        _socket_pipe(upstream, guest, counts, meter, False, idle),
        idle,
    )


async def readable(sock: socket.socket, timeout: float) -> bool:
    """Wait until ``sock`` has something to read (or its end); False on timeout."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())


def close_soon(writer: asyncio.StreamWriter) -> None:
    """Close ``writer``, and abort it if its last bytes have not gone in CLOSE_SECS: a
    peer that never reads (a zero window) must not keep a socket, and with it a
    namespace, alive."""
    writer.close()
    transport = writer.transport
    try:
        unsent = transport.get_write_buffer_size()
    except AttributeError:  # a TLS transport whose connection is already gone
        return
    if not transport.is_closing() or unsent:
        asyncio.get_running_loop().call_later(CLOSE_SECS, transport.abort)


def close_socket_soon(sock: socket.socket) -> None:
    """:func:`close_soon` for a bare socket: closed now when the kernel sent all it
    was given, else given CLOSE_SECS to, and then reset."""
    if sock.fileno() < 0:
        return
    try:
        unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        unsent = 0
    if not unsent:
        sock.close()
        return
    asyncio.get_running_loop().call_later(CLOSE_SECS, _reset, sock)


def _reset(sock: socket.socket) -> None:
    if sock.fileno() < 0:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
