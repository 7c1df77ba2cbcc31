"""Unfinished requests and piled-up connections (``forkd.controller.connection_limits``).

Each test runs a real uvicorn on loopback with the limits' protocol and talks to it
over raw sockets, with short timeouts (0.5 s). A small app stands for the routes'
kinds (an upload read as it streams, an event stream, a WebSocket); the daemon's
own app, ``forkd serve``'s and ``forkd gateway``'s servers and options follow.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from typer.testing import CliRunner
from websockets.sync.client import connect as ws_connect

from forkd import limits
from forkd.cli import app as cli_app
from forkd.client import Controller, Sandbox
from forkd.controller.app import create_app
from forkd.controller.connection_limits import (
    ConnectionLimiter,
    ConnectionLimits,
    uvicorn_options,
)
from forkd.controller.settings import Settings
from forkd.errors import Invalid
from forkd.launcher import free_port
from tests.unit.conftest import TOKEN, serving
from tests.unit.fakes import FakeDriver, make_image

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 0.5  # the header timeout and the body idle timeout of these tests
QUIET_SECS = 4 * TIMEOUT  # a stream or a WebSocket left quiet this long
SLACK = 2.0  # a loaded machine's delay on top of a timeout
SHORT = ConnectionLimits(header_timeout_secs=TIMEOUT, body_idle_timeout_secs=TIMEOUT)
LONG_SECS = 60.0  # for the cap tests: nothing times out in them


# ------------------------------------------------------------------ a small app


async def _ping(_request: Request) -> Response:
    return PlainTextResponse("pong")


async def _upload(request: Request) -> Response:
    """The body's length, read as it streams; ``?wait=S`` first does nothing for S s."""
    await asyncio.sleep(float(request.query_params.get("wait", 0)))
    received = 0
    try:
        async for piece in request.stream():
            received += len(piece)
    except ClientDisconnect:
        return Response(status_code=400)  # to nobody: the connection was cut
    return JSONResponse({"bytes": received})


async def _events(_request: Request) -> Response:
    async def stream() -> Any:
        yield b"data: first\n\n"
        await asyncio.sleep(QUIET_SECS)
        yield b"data: second\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def _echo(websocket: WebSocket) -> None:
    await websocket.accept()
    async for text in websocket.iter_text():
        await websocket.send_text(text)


APP = Starlette(
    routes=[
        Route("/ping", _ping),
        Route("/upload", _upload, methods=["POST"]),
        Route("/events", _events),
        WebSocketRoute("/echo", _echo),
    ]
)


@dataclass
class Served:
    limiter: ConnectionLimiter
    port: int  # 0 on a unix socket


OWNER = "owner-token"  # what the small app's limiter takes for the owner's token


@contextmanager
def limited(connection_limits: ConnectionLimits, uds: str | None = None) -> Iterator[Served]:
    """The small app under uvicorn with ``connection_limits``, on 127.0.0.1 or ``uds``."""
    limiter = ConnectionLimiter(connection_limits, owner_token=OWNER)
    port = 0 if uds else free_port()
    where = {"uds": uds} if uds else {"host": "127.0.0.1", "port": port}
    with serving(APP, **uvicorn_options(limiter), **where):
        yield Served(limiter, port)


@pytest.fixture
def port() -> Iterator[int]:
    """The small app with 0.5 s timeouts and the default caps."""
    with limited(SHORT) as served:
        yield served.port


# ------------------------------------------------------------------ raw sockets


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def read_until_closed(sock: socket.socket, within: float) -> bytes:
    """All the server sends until it closes the connection; fails if it is still open
    ``within`` seconds from now."""
    received = b""
    deadline = time.monotonic() + within
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            pytest.fail(f"still open after {within} s; received {received!r}")
        except ConnectionResetError:
            return received
        if not piece:
            return received
        received += piece


def is_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True  # nothing to read, and no end
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length."""
    sock.settimeout(10)
    received = b""
    while b"\r\n\r\n" not in received:
        piece = sock.recv(65536)
        assert piece, f"closed mid-answer: {received!r}"
        received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        piece = sock.recv(65536)
        assert piece, f"closed mid-answer: {received!r}"
        body += piece
    return head + b"\r\n\r\n" + body


def ping(sock: socket.socket, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n" + auth + b"\r\n")
    return read_answer(sock)


def upload_head(length: int, *extra: bytes, wait: float = 0) -> bytes:
    lines = [
        f"POST /upload?wait={wait} HTTP/1.1".encode(),
        b"Host: t",
        f"Content-Length: {length}".encode(),
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# ------------------------------------------------------------------ the request head


def test_half_a_request_head_is_closed_at_the_header_timeout(port: int) -> None:
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: t\r\n")  # no blank line: not whole
        assert read_until_closed(sock, TIMEOUT + SLACK) == b""
        assert time.monotonic() - started >= TIMEOUT * 0.9


def test_a_head_trickled_byte_by_byte_is_closed_at_the_header_timeout_all_the_same(
    port: int,
) -> None:
    head = b"GET /ping HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"x" * 100
    with connect(port) as sock:
        started = time.monotonic()
        for byte in head:  # one byte every 0.1 s: none restarts the wait
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(TIMEOUT / 5)
            if not is_open(sock):
                break
        closed_after = time.monotonic() - started
        assert not is_open(sock)
        assert TIMEOUT * 0.9 <= closed_after <= TIMEOUT + SLACK


def test_an_idle_keep_alive_connection_is_closed_even_after_starting_its_next_head(
    port: int,
) -> None:
    with connect(port) as sock:
        assert ping(sock).startswith(b"HTTP/1.1 200")
        assert ping(sock).endswith(b"pong")  # kept alive
        started = time.monotonic()
        sock.sendall(b"G")  # uvicorn's own keep-alive wait ends at any byte; this one does not
        assert read_until_closed(sock, TIMEOUT + SLACK) == b""
        assert time.monotonic() - started >= TIMEOUT * 0.9


# ------------------------------------------------------------------ the request body


def test_a_body_whose_bytes_stop_for_longer_than_the_idle_timeout_is_cut(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(upload_head(10) + b"ab")
        time.sleep(TIMEOUT / 2)
        sock.sendall(b"c")  # the next byte would come later than the idle timeout
        started = time.monotonic()
        answer = read_until_closed(sock, TIMEOUT + SLACK)
        assert answer == b""  # cut, not answered
        assert time.monotonic() - started >= TIMEOUT * 0.9


def test_a_body_trickled_faster_than_the_idle_timeout_arrives_however_long_it_takes() -> None:
    idle = 4 * TIMEOUT  # a byte every TIMEOUT: room for a loaded machine's late wake-ups
    body = b"0123456789ab"
    with (
        limited(ConnectionLimits(TIMEOUT, idle)) as served,
        connect(served.port) as sock,
    ):
        started = time.monotonic()
        sock.sendall(upload_head(len(body)))
        for byte in body:
            time.sleep(TIMEOUT)
            sock.sendall(bytes([byte]))
        answer = read_answer(sock)
        assert time.monotonic() - started > 2 * idle  # longer than either timeout
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"bytes": len(body)}


def test_a_body_the_app_reads_late_is_not_cut_while_the_server_holds_it_back(port: int) -> None:
    """The app takes nothing for 2 s: the server stops reading (flow control), so the
    client cannot send; that is no idle client."""
    body = b"x" * (8 << 20)
    with connect(port) as sock:
        sock.sendall(upload_head(len(body), wait=QUIET_SECS))
        sender = threading.Thread(target=sock.sendall, args=(body,), daemon=True)
        sender.start()
        answer = read_answer(sock)
        sender.join(10)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"bytes": len(body)}


def test_a_client_waiting_for_100_continue_is_not_cut(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(upload_head(5, b"Expect: 100-continue", wait=QUIET_SECS))
        sock.settimeout(QUIET_SECS + SLACK)
        assert sock.recv(4096).startswith(b"HTTP/1.1 100")  # once the app reads
        sock.sendall(b"hello")
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert answer.endswith(b'{"bytes":5}')


# ------------------------------------------------------------------ what streams


def test_an_event_stream_stays_open_past_both_timeouts_while_quiet(port: int) -> None:
    started = time.monotonic()
    with httpx.stream("GET", f"http://127.0.0.1:{port}/events", timeout=10) as answer:
        data = [line for line in answer.iter_lines() if line]
    assert data == ["data: first", "data: second"]
    assert time.monotonic() - started >= QUIET_SECS


def test_a_websocket_stays_open_past_both_timeouts(port: int) -> None:
    with ws_connect(f"ws://127.0.0.1:{port}/echo", open_timeout=10) as ws:
        ws.send("one")
        assert ws.recv(timeout=10) == "one"
        time.sleep(QUIET_SECS)
        ws.send("two")
        assert ws.recv(timeout=10) == "two"


# ------------------------------------------------------------------ the caps


def caps(per_address: int, total: int) -> ConnectionLimits:
    return ConnectionLimits(LONG_SECS, LONG_SECS, per_address, total)


def held(port: int, source: str = "127.0.0.1", token: str | None = OWNER) -> socket.socket:
    """A connection the server admitted (it answered), kept open: the owner's (never
    closed for another) unless ``token`` is None."""
    sock = connect(port, source)
    assert ping(sock, token).endswith(b"pong")
    return sock


def refusal(sock: socket.socket) -> str:
    answer = read_until_closed(sock, SLACK)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"connection: close" in answer.lower()
    return json.loads(answer.partition(b"\r\n\r\n")[2])["error"]


def admitted_again(connect_one: Any) -> socket.socket:
    """A connection admitted once the server has seen an earlier one close (the
    owner's)."""
    deadline = time.monotonic() + SLACK
    while True:
        sock = connect_one()
        try:
            answer = ping(sock, OWNER)
            if answer.startswith(b"HTTP/1.1 200"):
                return sock
        except (AssertionError, OSError):
            pass
        sock.close()
        assert time.monotonic() < deadline, "no connection admitted after one closed"
        time.sleep(0.05)


def open_count_becomes(limiter: ConnectionLimiter, n: int) -> None:
    deadline = time.monotonic() + SLACK
    while limiter.counts().open != n:
        assert time.monotonic() < deadline, f"{limiter.counts().open} open, not {n}"
        time.sleep(0.02)


def test_the_per_address_cap_refuses_one_more_from_that_address_until_one_closes() -> None:
    with limited(caps(per_address=3, total=100)) as served:
        port, limiter = served.port, served.limiter
        socks = [held(port) for _ in range(3)]
        with connect(port) as fourth:
            assert "from this address" in refusal(fourth)
        other = held(port, "127.0.0.2")  # another address has room of its own
        socks[0].close()
        socks[0] = admitted_again(lambda: connect(port))
        assert limiter.counts().refused["address"] >= 1
        assert limiter.counts().refused["total"] == 0
        for sock in [*socks, other]:
            sock.close()
        open_count_becomes(limiter, 0)


def test_the_total_cap_refuses_one_more_from_any_address_until_one_closes() -> None:
    with limited(caps(per_address=100, total=3)) as served:
        port, limiter = served.port, served.limiter
        socks = [held(port, f"127.0.0.{i}") for i in (1, 2, 3)]
        with connect(port, "127.0.0.4") as fourth:
            assert refusal(fourth).startswith("too many connections:")
        socks[1].close()
        socks[1] = admitted_again(lambda: connect(port, "127.0.0.4"))
        assert limiter.counts().refused == {"address": 0, "total": 1}
        for sock in socks:
            sock.close()
        open_count_becomes(limiter, 0)


def test_unix_socket_clients_count_against_the_total_only(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")

    def unix() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(path)
        return sock

    with limited(caps(per_address=1, total=3), uds=path) as served:
        socks = []
        for _ in range(3):  # one "address" each would refuse the second
            socks.append(unix())
            assert ping(socks[-1], OWNER).endswith(b"pong")
        with unix() as fourth:
            assert refusal(fourth).startswith("too many connections:")
        socks[0].close()
        socks[0] = admitted_again(unix)
        for sock in socks:
            sock.close()
        open_count_becomes(served.limiter, 0)


def test_a_websocket_holds_its_slot_until_it_closes_and_then_gives_it_back() -> None:
    with limited(caps(per_address=2, total=100)) as served:
        port, limiter = served.port, served.limiter
        with ws_connect(f"ws://127.0.0.1:{port}/echo", open_timeout=10) as ws:
            ws.send("hi")
            assert ws.recv(timeout=10) == "hi"
            other = held(port)
            with connect(port) as third:
                refusal(third)
        again = admitted_again(lambda: connect(port))
        for sock in (other, again):
            sock.close()
        open_count_becomes(limiter, 0)


def test_a_flood_of_idle_connections_without_the_token_cannot_keep_the_owner_out(
    daemon_with_caps: tuple[str, ConnectionLimiter],
) -> None:
    """Issue 35: any local process, without a token, held every connection with keep-alive
    /healthz requests from several loopback addresses, and the owner got 503s."""
    url, limiter = daemon_with_caps
    port = int(url.rpartition(":")[2])
    stop = threading.Event()
    flooders = [f"127.0.0.{i}" for i in (2, 3, 4, 5)]  # 4 x 8: every connection the caps allow

    def flood(source: str) -> None:
        socks: list[socket.socket] = []
        while not stop.is_set():
            for sock in list(socks):
                try:  # a keep-alive /healthz now and then on each
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                    read_answer(sock)
                except (AssertionError, OSError):
                    socks.remove(sock)
                    sock.close()
            while len(socks) < 8 and not stop.is_set():  # and each one closed, opened again
                try:
                    socks.append(connect(port, source))
                except OSError:
                    break
            time.sleep(0.05)
        for sock in socks:
            sock.close()

    threads = [threading.Thread(target=flood, args=(a,)) for a in flooders]
    for thread in threads:
        thread.start()
    try:
        # The flood holds all it may (all but the owner's share), its connections closed
        # for one another as it opens more.
        deadline = time.monotonic() + 10
        while limiter.counts().open < 24 or limiter.counts().closed_for_another < 32:
            assert time.monotonic() < deadline, (
                f"the flood never filled the daemon: {limiter.counts()}"
            )
            time.sleep(0.02)
        answers = []
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for _ in range(20):  # each on a new connection, as a CLI's calls come
            with httpx.Client(headers=auth, timeout=10) as http:
                answers.append(http.get(f"{url}/v1/sandboxes").status_code)
        with httpx.Client(headers=auth, timeout=10) as http:  # and on one kept open
            answers += [http.get(f"{url}/v1/sandboxes").status_code for _ in range(20)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert answers == [200] * 40, answers
    assert limiter.counts().refused == {"address": 0, "total": 0}


@pytest.fixture
def daemon_with_caps(
    settings: Settings, driver: FakeDriver
) -> Iterator[tuple[str, ConnectionLimiter]]:
    """The daemon's app with 8 connections an address, 32 in all."""
    limiter = ConnectionLimiter(caps(per_address=8, total=32), owner_token=TOKEN)
    with serving_daemon(settings, driver, limiter) as url:
        yield url, limiter


@contextmanager
def serving_daemon(
    settings: Settings, driver: FakeDriver, limiter: ConnectionLimiter
) -> Iterator[str]:
    """The daemon's app over the fake driver, served as ``forkd serve`` serves it under
    ``limiter``; its URL."""
    port = free_port()
    app = create_app(settings, TOKEN, driver=driver, connections=limiter)
    with serving(app, host="127.0.0.1", port=port, **uvicorn_options(limiter)):
        yield f"http://127.0.0.1:{port}"


def test_bodies_trickled_without_the_token_cannot_keep_the_owner_out(
    daemon_with_caps: tuple[str, ConnectionLimiter],
) -> None:
    """A review's lock-out: the token-free /healthz reads its body before answering, so
    connections that declare a 1 MB body and trickle it never went idle and were never
    closed for the owner (all from 127.0.0.1, the owner's own address, as well)."""
    url, limiter = daemon_with_caps
    port = int(url.rpartition(":")[2])
    trickling = []
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"):
        for _ in range(8):  # every connection the caps allow
            sock = connect(port, source)
            sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\nx")
            trickling.append(sock)
    # They close one another's down to all but the owner's share (a quarter), then hold.
    open_count_becomes(limiter, 24)
    time.sleep(0.6)  # past the grace a new connection has
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        answers = []
        for _ in range(5):
            with httpx.Client(headers=auth, timeout=10) as http:
                answers.append(http.get(f"{url}/v1/sandboxes").status_code)
        assert answers == [200] * 5, (answers, limiter.counts())
        assert limiter.counts().closed_for_another >= 5
    finally:
        for sock in trickling:
            sock.close()


def test_an_answer_given_before_the_body_was_read_ends_a_connection_without_the_token() -> None:
    with limited(caps(per_address=100, total=100)) as served:
        stranger = connect(served.port)
        # /nowhere answers 404 without reading the body; its rest would hold the connection
        stranger.sendall(b"POST /nowhere HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\nx")
        assert read_until_closed(stranger, SLACK).startswith(b"HTTP/1.1 404")
        stranger.close()


def test_a_token_in_a_pipelined_request_makes_the_connection_the_owners() -> None:
    with limited(caps(per_address=100, total=100)) as served:
        sock = connect(served.port)
        sock.sendall(
            b"GET /ping HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /ping HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
            + OWNER.encode()
            + b"\r\n\r\n"
        )
        answers, deadline = b"", time.monotonic() + SLACK
        while answers.count(b"pong") < 2:  # both may come in one read
            assert time.monotonic() < deadline, answers
            answers += sock.recv(65536)
        deadline = time.monotonic() + SLACK
        while not any(slot.owner for slot in served.limiter._slots):
            assert time.monotonic() < deadline, "the pipelined token was not seen"
            time.sleep(0.02)
        sock.close()


def test_a_connection_let_in_on_the_owners_share_must_send_the_token() -> None:
    with limited(caps(per_address=100, total=4)) as served:  # 1 of 4 kept for the owner
        port = served.port
        busy = [connect(port) for _ in range(3)]
        for sock in busy:  # streams under way: never closed for another
            sock.sendall(b"GET /events HTTP/1.1\r\nHost: t\r\n\r\n")
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        open_count_becomes(served.limiter, 3)
        with connect(port) as stranger:  # on the owner's share: answered, then closed
            assert ping(stranger).endswith(b"pong")
            assert read_until_closed(stranger, SLACK) == b""
        owner = admitted_again(lambda: connect(port))
        with connect(port, "127.0.0.9") as one_more:  # the owner's share taken: refused
            assert refusal(one_more).startswith("too many connections:")
        owner.close()
        for sock in busy:
            sock.close()


def test_a_keep_alive_connection_without_the_token_lives_only_so_long() -> None:
    limits_ = ConnectionLimits(LONG_SECS, LONG_SECS, unauthenticated_keepalive_secs=0.5)
    with limited(limits_) as served:
        stranger, owner = held(served.port, token=None), held(served.port)
        time.sleep(0.6)
        assert ping(stranger).endswith(b"pong")  # answered, then closed
        assert read_until_closed(stranger, SLACK) == b""
        assert ping(owner).endswith(b"pong") and is_open(owner)
        stranger.close()
        owner.close()


def test_an_idle_connection_without_the_token_is_closed_for_a_newcomer() -> None:
    with limited(caps(per_address=2, total=100)) as served:
        port = served.port
        stranger, owner = held(port, token=None), held(port)
        time.sleep(0.6)  # a connection younger than half a second is not closed for another
        with connect(port) as newcomer:
            assert ping(newcomer).endswith(b"pong")
            assert read_until_closed(stranger, SLACK) == b""  # the idle stranger made room
            assert is_open(owner)
            time.sleep(0.6)
            with connect(port) as another:  # the owner's and the newcomer's: refused?
                # The newcomer sent no token and is idle now: it makes room in turn.
                assert ping(another).endswith(b"pong")
        owner.close()
        stranger.close()


def test_limits_must_be_positive() -> None:
    for bad in (
        {"header_timeout_secs": 0},
        {"body_idle_timeout_secs": float("nan")},
        {"max_per_address": 0},
        {"max_total": 0},
    ):
        with pytest.raises(Invalid):
            ConnectionLimits(**bad)


def test_the_default_total_leaves_half_the_descriptors_to_the_vms() -> None:
    assert limits.default_max_connections(1 << 20) == limits.MAX_CONNECTIONS
    assert limits.default_max_connections(1024) == 512
    assert limits.default_max_connections() <= limits.MAX_CONNECTIONS


# ------------------------------------------------------------------ the daemon's app


@pytest.fixture
def daemon(settings: Settings, driver: FakeDriver) -> Iterator[tuple[str, ConnectionLimiter]]:
    """The daemon's app over the fake driver, served as ``forkd serve`` serves it."""
    limiter = ConnectionLimiter(SHORT)
    with serving_daemon(settings, driver, limiter) as url:
        yield url, limiter


def test_the_daemons_event_stream_and_terminal_outlive_both_timeouts(
    daemon: tuple[str, ConnectionLimiter],
) -> None:
    url, _ = daemon
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with (
        Controller(url, token=TOKEN, timeout=10) as ctl,
        httpx.Client(headers=auth, timeout=10) as http,
        http.stream("GET", f"{url}/v1/events", params={"type": "created"}) as events,
    ):
        assert events.status_code == 200
        ctl.create_snapshot("py", memory_mib=128)
        [child] = ctl.spawn_sandboxes("py")
        sb = Sandbox.connect(child["id"], controller=ctl)
        with sb.pty.create(cmd=["cat"]) as term:
            time.sleep(QUIET_SECS)  # both quiet: no event, no keystroke
            [second] = ctl.spawn_sandboxes("py")
            lines = events.iter_lines()
            seen = ""
            while second["id"] not in seen:
                seen += next(lines)  # the stream is still open: the event comes
            term.send_stdin("still here\n")
            echoed = b""
            deadline = time.monotonic() + 10
            while b"still here" not in echoed:
                assert time.monotonic() < deadline, echoed
                echoed += term.read(timeout=0.5) or b""


def test_the_daemons_metrics_count_open_refused_and_timed_out_connections(
    daemon: tuple[str, ConnectionLimiter],
) -> None:
    url, _ = daemon
    port = int(url.rpartition(":")[2])
    with connect(port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        read_until_closed(sock, TIMEOUT + SLACK)
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'forkd_connections_timed_out_total{wait="header"} 1\n' in text
    assert 'forkd_connections_timed_out_total{wait="body"} 0\n' in text
    assert 'forkd_connections_refused_total{cap="total"} 0\n' in text
    assert "forkd_connections_open 1\n" in text  # the scrape's own


# ------------------------------------------------------------------ the servers and options


SERVE = """
import sys
from pathlib import Path
from forkd.controller.connection_limits import ConnectionLimits
from forkd.controller.server import serve
from forkd.controller.settings import Settings
from tests.unit.fakes import FakeDriver
state = Path(sys.argv[1])
settings = Settings(state_dir=state, snapshot_root=state / "snapshots", run_dir=state / "run",
                    pool_size=0, connection_limits=ConnectionLimits(header_timeout_secs=0.5))
serve(settings, sys.argv[2], driver=FakeDriver(), log_level="warning")
"""

GATEWAY = """
import sys
from forkd.controller.connection_limits import ConnectionLimits
from forkd.gateway.app import create_app, serve
from forkd.gateway.nodes import NodeSet
nodes = NodeSet([sys.argv[1]], None)
serve(create_app(nodes, None), sys.argv[2], "warning", ConnectionLimits(header_timeout_secs=0.5))
"""


@contextmanager
def process(tmp_path: Path, script: str, *args: str, ready: Any) -> Iterator[None]:
    """``script`` in a process of its own until the block ends; ``ready()`` says it listens."""
    cache = tmp_path / "cache"
    make_image(cache)
    # The repository (for tests.unit.fakes) before the forkd this process imported.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    python_path = os.pathsep.join([str(REPO), *inherited])
    env = {**os.environ, "FORKD_CACHE_DIR": str(cache), "PYTHONPATH": python_path}
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *args], cwd=REPO, env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 30
        while not ready():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _listens(connect_one: Any) -> bool:
    try:
        connect_one().close()
    except OSError:
        return False
    return True


def test_forkd_serve_closes_half_a_head_on_its_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"

    def unix() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        return sock

    with (
        process(
            tmp_path, SERVE, str(tmp_path / "state"), f"unix:{path}", ready=lambda: _listens(unix)
        ),
        unix() as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        assert read_until_closed(sock, TIMEOUT + SLACK) == b""


def test_forkd_gateway_closes_half_a_head(tmp_path: Path) -> None:
    port = free_port()
    nowhere = f"http://127.0.0.1:{free_port()}"  # a node that is down
    with (
        process(
            tmp_path,
            GATEWAY,
            nowhere,
            f"127.0.0.1:{port}",
            ready=lambda: _listens(lambda: connect(port)),
        ),
        connect(port) as sock,
    ):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        assert read_until_closed(sock, TIMEOUT + SLACK) == b""


OPTIONS = [
    "--header-timeout",
    "3",
    "--body-idle-timeout",
    "7",
    "--max-connections-per-address",
    "5",
    "--max-connections",
    "9",
]


def test_forkd_serve_takes_the_options_into_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[Settings] = []
    monkeypatch.setattr("forkd.controller.server.serve", lambda s, *_a, **_k: taken.append(s))
    monkeypatch.setattr("forkd.cli.daemon._use_qemu_user", lambda *_args: None)
    base = ["serve", "--state-dir", str(tmp_path), "--cgroup-parent", "none", "--accel", "tcg"]
    for args in ([], OPTIONS):
        result = CliRunner().invoke(cli_app, base + args)
        assert result.exit_code == 0, result.output
    assert taken[0].connection_limits == ConnectionLimits(
        max_total=limits.default_max_connections()
    )
    assert taken[1].connection_limits == ConnectionLimits(3, 7, 5, 9)


def test_forkd_gateway_takes_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[ConnectionLimits] = []
    monkeypatch.setattr("forkd.gateway.app.serve", lambda *args, **_kw: taken.append(args[3]))
    base = ["gateway", "--node", "http://127.0.0.1:1", "--insecure-no-auth"]
    for args in ([], OPTIONS):
        result = CliRunner().invoke(cli_app, base + args)
        assert result.exit_code == 0, result.output
    assert taken == [
        ConnectionLimits(max_total=limits.default_max_connections()),
        ConnectionLimits(3, 7, 5, 9),
    ]
