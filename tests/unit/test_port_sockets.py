"""WebSockets to a guest port: proxied upgrades, raw TCP tunnels, the SDK's ports and
``forkd port-forward``, over the fake driver under a real uvicorn on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import wsproto.events
from httpx_ws import WebSocketDisconnect
from typer.testing import CliRunner

from forkd.cli import app
from forkd.client import Controller, ControllerError, Sandbox
from forkd.client.port_routes import forward_port
from tests.integration import guest_web
from tests.unit import port_fixtures
from tests.unit.conftest import Server

ECHO_PORT = 7000

GUEST_PORT = port_fixtures.GUEST_PORT
web, http, sid, _vm = port_fixtures.web, port_fixtures.http, port_fixtures.sid, port_fixtures.vm


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, timeout=10) as c:
        yield c


@pytest.fixture
def sb(ctl: Controller, sid: str, server: Server) -> Iterator[Sandbox]:
    echo = guest_web.serve_tcp_echo("127.0.0.1", 0)
    _vm(server, sid).ports[ECHO_PORT] = echo.getsockname()[1]
    yield Sandbox.connect(sid, controller=ctl)
    echo.close()


def _text(ws: object) -> str:
    event = ws.receive(timeout=5)  # type: ignore[attr-defined]
    assert isinstance(event, wsproto.events.TextMessage), event
    return str(event.data)


def test_the_sdk_gives_the_proxy_url_and_a_preview_url(sb: Sandbox, ctl: Controller) -> None:
    url = sb.get_url(GUEST_PORT, "/a?b=1")
    assert url == f"{ctl.base_url}/v1/sandboxes/{sb.id}/ports/{GUEST_PORT}/a?b=1"
    assert ctl._client.get(url).text == "hello from the fake guest at /a?b=1\n"
    preview = sb.preview_url(GUEST_PORT, ttl_s=60)
    assert httpx.get(preview).status_code == 200  # no token


def test_a_websocket_is_relayed_through_the_proxy_with_its_subprotocol(sb: Sandbox) -> None:
    with sb.websocket(GUEST_PORT, "/ws", subprotocols=["chat", "other"]) as ws:
        assert ws.subprotocol == "chat"
        ws.send_text("hello")
        assert _text(ws) == "hello"
        ws.send_bytes(b"\x00\x01" * 40000)
        event = ws.receive(timeout=5)
        assert isinstance(event, wsproto.events.BytesMessage)
        assert bytes(event.data) == b"\x00\x01" * 40000


def test_a_websocket_through_a_preview_url_needs_no_token(
    sb: Sandbox, server: Server, ctl: Controller
) -> None:
    token = ctl.create_preview_url(sb.id, GUEST_PORT)["token"]
    with Controller(server.url, token="not-the-token") as stranger:
        with stranger._websocket(f"/v1/preview/{token}/ws", _headers()) as ws:
            ws.send_text("through the preview")
            assert _text(ws) == "through the preview"
        forged = f"/v1/preview/{token[:-2]}AA/ws"
        with pytest.raises(ControllerError) as refused, stranger._websocket(forged, _headers()):
            pass
        assert refused.value.status == 403


def _headers() -> dict[str, str]:
    from forkd.client.websockets import upgrade_headers

    return upgrade_headers()


def test_a_websocket_to_a_port_nothing_listens_on_is_refused_with_a_502(sb: Sandbox) -> None:
    with pytest.raises(ControllerError) as refused, sb.websocket(8001, "/ws"):
        pass
    assert refused.value.status == 502 and "nothing listens" in refused.value.message


def test_a_tunnel_carries_raw_bytes_both_ways_and_ends_with_the_guest(
    sb: Sandbox, ctl: Controller
) -> None:
    with ctl.open_tunnel(sb.id, ECHO_PORT) as ws:
        sent = b"not http at all\r\n\x00"
        ws.send_bytes(sent)
        got = b""
        while len(got) < len(sent):
            event = ws.receive(timeout=5)
            assert isinstance(event, wsproto.events.BytesMessage), event
            got += bytes(event.data)
        assert got == sent
        ws.send_text("eof")  # half-close: the echo service ends its side, then so do we
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive(timeout=5)
        assert closed.value.code == 1000


@pytest.mark.parametrize("port", [0, 8888, 70000])
def test_a_tunnel_to_a_bad_port_is_a_400(sb: Sandbox, ctl: Controller, port: int) -> None:
    with pytest.raises(ControllerError) as refused, ctl.open_tunnel(sb.id, port):
        pass
    assert refused.value.status == 400


def test_a_tunnel_ends_when_its_sandbox_is_killed(sb: Sandbox, ctl: Controller) -> None:
    with ctl.open_tunnel(sb.id, ECHO_PORT) as ws:
        ws.send_bytes(b"x")
        echoed = ws.receive(timeout=5)
        assert isinstance(echoed, wsproto.events.BytesMessage) and bytes(echoed.data) == b"x"
        sb.kill()
        started = time.monotonic()
        with pytest.raises(WebSocketDisconnect):
            while True:
                ws.receive(timeout=10)
        assert time.monotonic() - started < 5


def test_forward_port_serves_local_connections_through_tunnels(
    sb: Sandbox, ctl: Controller
) -> None:
    stop = threading.Event()
    ready: list[int] = []
    thread = threading.Thread(
        target=forward_port, args=(ctl, sb.id, GUEST_PORT, 0, ready.append, stop), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 5
    while not ready and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        for _ in range(2):  # each connection a tunnel of its own
            r = httpx.get(f"http://127.0.0.1:{ready[0]}/fwd", timeout=5)
            assert r.text == "hello from the fake guest at /fwd\n"
    finally:
        stop.set()
        thread.join(5)


def test_cli_port_forward_and_url(sb: Sandbox, server: Server) -> None:
    """``forkd port-forward`` prints the port it chose; ``forkd url`` a preview URL."""
    runner = CliRunner()
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    r = runner.invoke(app, ["url", sb.id, str(GUEST_PORT), "--ttl", "60"], env=env)
    assert r.exit_code == 0, r.output
    assert httpx.get(r.output.strip()).text.startswith("hello from the fake guest")
    r = runner.invoke(app, ["port-forward", sb.id, "0:70000"], env=env)
    assert r.exit_code == 1 and "1-65535" in r.output
    r = runner.invoke(app, ["port-forward", "sb-nope-0001", "8000"], env=env)
    assert r.exit_code == 1 and "not found" in r.output
    busy = socket.create_server(("127.0.0.1", 0))
    r = runner.invoke(
        app, ["port-forward", sb.id, f"{busy.getsockname()[1]}:{GUEST_PORT}"], env=env
    )
    busy.close()
    assert r.exit_code == 1 and "cannot listen" in r.output
