"""The request guard under a real uvicorn, sent what httpx never sends.

GuardMiddleware wraps an app that only counts the body bytes it is handed.
Raw sockets send inconsistent framing: a ``Content-Length`` together with
``Transfer-Encoding: chunked``, a ``Content-Length`` shorter than the body,
a chunked body with no length at all. Whatever the headers say, the app
must never be handed more than the route's limit.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from starlette.types import Receive, Scope, Send

from forkd.controller.middleware import GuardMiddleware
from forkd.launcher import free_port
from forkd.limits import JSON_BODY_LIMIT
from tests.unit.conftest import serving

TOKEN = "t0ken"
UPLOAD_LIMIT = 64 << 20  # of a streamed file upload, here; the daemon's default is far larger
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


@dataclass
class Counter:
    """An ASGI app that reads the whole body and notes how many bytes it got."""

    bodies: list[int] = field(default_factory=list)
    headers: list[dict[bytes, bytes]] = field(default_factory=list)
    messages: list[int] = field(default_factory=list)  # body messages received, per request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        seen = received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            received += 1
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self.bodies.append(seen)
        self.messages.append(received)
        self.headers.append(dict(scope["headers"]))
        body = str(seen).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def guarded() -> Iterator[tuple[int, Counter]]:
    counter = Counter()
    port = free_port()
    with serving(GuardMiddleware(counter, TOKEN, UPLOAD_LIMIT), host="127.0.0.1", port=port):
        yield port, counter


@dataclass
class Exchange:
    status: int | None  # None: the connection closed without an answer
    answer: bytes
    sent: int  # body bytes the client got into the socket before it closed
    closed: bool  # the server closed the connection (not our timeout)


def _exchange(port: int, head: str, body: Iterator[bytes]) -> Exchange:
    """Send ``head`` then ``body`` (from a thread, so a server that stops
    reading does not block us) and read until the server closes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sent = 0

    def pump() -> None:
        nonlocal sent
        try:
            sock.sendall(head.encode())
            for chunk in body:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: what a refusal looks like

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    answer, closed = b"", False
    try:
        while data := sock.recv(65536):
            answer += data
        closed = True
    except TimeoutError:
        pass
    except OSError:
        closed = True  # reset: the server closed with our bytes unread
    finally:
        sock.close()
        sender.join(20)
    status = int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else None
    return Exchange(status, answer, sent, closed)


def _chunked(total: int, piece: int = 64 << 10) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        yield b"%x\r\n" % n + b"x" * n + b"\r\n"
        sent += n
    yield b"0\r\n\r\n"


def _plain(total: int, piece: int = 64 << 10) -> Iterator[bytes]:
    for start in range(0, total, piece):
        yield b"x" * min(piece, total - start)


def _refused(ex: Exchange, status: int, total: int) -> None:
    """Refused with ``status`` (or closed before the answer could be read), and
    the connection closed long before the whole body could be sent."""
    assert ex.status in (status, None), ex.answer
    assert ex.closed, "the server kept the connection open"
    assert ex.sent < total, "the server read the whole body"


def test_content_length_with_chunked_cannot_smuggle_a_big_body(
    guarded: tuple[int, Counter],
) -> None:
    port, counter = guarded
    head = (
        f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 10\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    _refused(_exchange(port, head, _chunked(64 << 20)), 413, 64 << 20)
    assert counter.bodies == []


def test_the_same_on_a_raw_upload_route(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = (
        f"PUT /v1/sandboxes/sb-x-1/files?path=/a HTTP/1.1\r\nHost: x\r\n{AUTH}"
        "Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    _refused(_exchange(port, head, _chunked(200 << 20)), 413, 200 << 20)
    # The upload streams: the app read up to the limit, then saw the body end early.
    assert len(counter.bodies) == 1 and counter.bodies[0] <= UPLOAD_LIMIT


def test_a_volume_archive_is_still_capped_and_read_first(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = f"POST /v1/volumes HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n"
    total = 200 << 20  # well past FILE_BODY_LIMIT, and past what socket buffers hold
    _refused(_exchange(port, head, _chunked(total)), 413, total)
    assert counter.bodies == []


def test_a_short_content_length_hands_over_only_that_many_bytes(
    guarded: tuple[int, Counter],
) -> None:
    port, counter = guarded
    head = f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 10\r\n\r\n"
    ex = _exchange(port, head, _plain(64 << 20))
    # The app answers the 10 bytes the framing gave; what follows is not a
    # request, and uvicorn (h11) answers it 400 and closes the connection.
    assert ex.status == 200, ex.answer
    assert b"\r\n\r\n10HTTP/1.1 400 Bad Request\r\n" in ex.answer
    assert ex.closed and ex.sent < 64 << 20
    assert counter.bodies == [10]


def test_an_honest_oversized_length_is_refused_before_the_body(
    guarded: tuple[int, Counter],
) -> None:
    port, counter = guarded
    head = (
        f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}"
        f"Content-Length: {JSON_BODY_LIMIT + 1}\r\n\r\n"
    )
    ex = _exchange(port, head, iter(()))  # the body is never sent: no need to wait for it
    assert ex.status == 413 and ex.closed, ex.answer
    assert ex.answer.endswith(b'{"error":"request body over 1048576 bytes"}')
    assert counter.bodies == []


def test_a_chunked_body_at_the_limit_gets_through_whole(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = (
        f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    ex = _exchange(port, head, _chunked(JSON_BODY_LIMIT))
    assert ex.status == 200, ex.answer
    assert counter.bodies == [JSON_BODY_LIMIT]


def test_one_byte_over_the_limit_is_refused(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n"
    ex = _exchange(port, head, _chunked(JSON_BODY_LIMIT + 1))
    assert ex.status == 413 and ex.closed, ex.answer
    assert counter.bodies == []


def test_the_app_sees_the_length_it_is_handed(guarded: tuple[int, Counter]) -> None:
    """A lying Content-Length beside chunked framing is replaced by the real one."""
    port, counter = guarded
    head = (
        f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 10\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    ex = _exchange(port, head, _chunked(5000))
    assert ex.status == 200, ex.answer
    assert counter.bodies == [5000]
    headers = counter.headers[0]
    assert headers[b"content-length"] == b"5000" and b"transfer-encoding" not in headers


def test_a_body_on_a_get_is_bounded_too(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = f"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n"
    _refused(_exchange(port, head, _chunked(64 << 20)), 413, 64 << 20)
    assert counter.bodies == []


def test_without_the_token_no_body_is_read(guarded: tuple[int, Counter]) -> None:
    port, counter = guarded
    head = (
        "POST /v1/snapshots HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    _refused(_exchange(port, head, _chunked(64 << 20)), 401, 64 << 20)
    assert counter.bodies == []


def test_a_file_upload_at_its_limit_streams_through(guarded: tuple[int, Counter]) -> None:
    """Past the 32 MiB of the buffered routes, handed over as it arrives, not in one piece."""
    port, counter = guarded
    head = (
        f"PUT /v1/sandboxes/sb-x-1/files?path=/a HTTP/1.1\r\nHost: x\r\n{AUTH}"
        "Content-Length: 10\r\nTransfer-Encoding: chunked\r\n"
        "Connection: close\r\n\r\n"
    )
    ex = _exchange(port, head, _chunked(UPLOAD_LIMIT, piece=1 << 20))
    assert ex.status == 200, ex.answer
    assert counter.bodies == [UPLOAD_LIMIT]
    assert counter.messages[0] > 1


def test_an_honest_length_over_the_upload_limit_is_refused_unread(
    guarded: tuple[int, Counter],
) -> None:
    port, counter = guarded
    head = (
        f"PUT /v1/sandboxes/sb-x-1/files?path=/a HTTP/1.1\r\nHost: x\r\n{AUTH}"
        f"Content-Length: {UPLOAD_LIMIT + 1}\r\n\r\n"
    )
    ex = _exchange(port, head, iter(()))
    assert ex.status == 413 and ex.closed, ex.answer
    assert counter.bodies == []
