"""The terminal WebSocket (``GET .../processes/{pid}/pty``) and ``sb.pty`` over the fake driver.

The handshake's auth and refusals are checked in-process (Starlette's
TestClient); the sessions run under a real uvicorn on loopback, so frames,
closes and flow control are those of a real socket. The fake guest's ``cat``
in a terminal echoes keystrokes; ``flood`` writes until it is killed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from starlette.types import Message
from starlette.websockets import WebSocketDisconnect

from forkd.client import Controller, ControllerError, Sandbox
from forkd.client.pty import LOGIN_SHELL, PtyHandle
from forkd.controller.http_errors import close_reason
from forkd.controller.middleware import GuardMiddleware
from forkd.controller.services import terminals
from forkd.controller.services.processes import BULK_LINGER_SECS, READ_BYTES
from tests.unit.conftest import Server
from tests.unit.fakes import FakeVM


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, timeout=10) as c:
        yield c


@pytest.fixture
def sb(ctl: Controller, sid: str) -> Sandbox:
    return Sandbox.connect(sid, controller=ctl)


def _vm(server: Server, sandbox_id: str) -> FakeVM:
    return next(vm for vm in server.driver.vms if vm.id == sandbox_id)


def _pty_path(sandbox_id: str, pid: int) -> str:
    return f"/v1/sandboxes/{sandbox_id}/processes/{pid}/pty"


def _read_until(term: PtyHandle, wanted: bytes, timeout: float = 10) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        assert time.monotonic() < deadline, f"never saw {wanted!r} in {seen!r}"
        piece = term.read(timeout=0.5)
        assert piece is not None, f"the process exited before {wanted!r}: {seen!r}"
        seen += piece
    return seen


# -- the handshake: auth, refusals, the audit log ------------------------------------


def _started(client: TestClient, cmd: list[str], pty: bool = True) -> tuple[str, int]:
    assert client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    sandbox_id = client.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
    body: dict[str, Any] = {"cmd": cmd, "stdin": True}
    if pty:
        body["pty"] = {"cols": 80, "rows": 24}
    r = client.post(f"/v1/sandboxes/{sandbox_id}/processes", json=body)
    assert r.status_code == 201, r.text
    return sandbox_id, int(r.json()["pid"])


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", "unit-test-token"])
def test_a_websocket_without_the_bearer_token_is_refused_and_audited(
    client: TestClient, settings: Any, authorization: str | None
) -> None:
    sandbox_id, pid = _started(client, ["cat"])
    headers = {"Authorization": authorization or ""}
    with pytest.raises(WebSocketDenialResponse) as refused:
        client.websocket_connect(_pty_path(sandbox_id, pid), headers=headers).__enter__()
    assert refused.value.status_code == 401
    assert refused.value.json() == {"error": "missing or wrong bearer token"}
    lines = (Path(settings.state_dir) / "audit.log").read_text().splitlines()
    record = json.loads(lines[-1])
    assert record["status"] == 401 and record["websocket"] is True
    assert record["method"] == "GET" and record["sandbox_id"] == sandbox_id


def test_the_right_token_opens_the_socket_and_the_audit_log_says_101(
    client: TestClient, settings: Any
) -> None:
    sandbox_id, pid = _started(client, ["cat"])
    with client.websocket_connect(_pty_path(sandbox_id, pid)) as ws:
        ws.send_bytes(b"hi\n")
        assert ws.receive_bytes() == b"hi\n"
    lines = (Path(settings.state_dir) / "audit.log").read_text().splitlines()
    record = json.loads(lines[-1])
    assert record["status"] == 101 and record["websocket"] is True


@pytest.mark.parametrize(
    ("target", "status", "message"),
    [
        ("unknown-sandbox", 404, "not found"),
        ("unknown-pid", 404, "no background process with pid 999"),
        ("no-terminal", 400, "has no terminal"),
        ("past-the-end", 400, "past the end of the output"),
    ],
)
def test_what_has_no_terminal_to_open_is_refused_before_the_handshake(
    client: TestClient, target: str, status: int, message: str
) -> None:
    sandbox_id, pid = _started(client, ["cat"], pty=target != "no-terminal")
    path = {
        "unknown-sandbox": _pty_path("sb-nope", pid),
        "unknown-pid": _pty_path(sandbox_id, 999),
        "no-terminal": _pty_path(sandbox_id, pid),
        "past-the-end": _pty_path(sandbox_id, pid) + "?offset=5",
    }[target]
    with pytest.raises(WebSocketDenialResponse) as refused:
        client.websocket_connect(path).__enter__()
    assert refused.value.status_code == status
    assert message in refused.value.json()["error"]


def test_a_bad_control_frame_is_an_error_frame_and_the_session_goes_on(
    client: TestClient,
) -> None:
    sandbox_id, pid = _started(client, ["cat"])
    with client.websocket_connect(_pty_path(sandbox_id, pid)) as ws:
        for bad in ("not json", '{"type": "resize", "cols": 0, "rows": 5}', '{"type": "x"}'):
            ws.send_text(bad)
            frame = json.loads(ws.receive_text())
            assert frame["type"] == "error" and frame["status"] == 400
        ws.send_bytes(b"still here\n")
        assert ws.receive_bytes() == b"still here\n"


def test_the_exit_is_a_text_frame_then_a_normal_close(client: TestClient) -> None:
    sandbox_id, pid = _started(client, ["cat"])
    with client.websocket_connect(_pty_path(sandbox_id, pid)) as ws:
        assert (
            client.post(
                f"/v1/sandboxes/{sandbox_id}/processes/{pid}/signal", json={"signal": "KILL"}
            ).status_code
            == 204
        )
        assert json.loads(ws.receive_text()) == {"type": "exit", "exit_code": 137}
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_bytes()
        assert closed.value.code == 1000


# -- sb.pty over a real socket -----------------------------------------------------


def test_sdk_create_echo_resize_and_kill(sb: Sandbox, server: Server) -> None:
    seen: list[bytes] = []
    with sb.pty.create(cols=100, rows=30, cmd=["cat"], on_data=seen.append) as term:
        proc = _vm(server, sb.id).processes.procs[term.pid]
        assert proc.pty and proc.size == (100, 30)
        term.send_stdin("hello\n")
        term.send_stdin(b"\xff\x00bytes\n")
        assert _read_until(term, b"\xff\x00bytes\n") == b"hello\n\xff\x00bytes\n"
        assert b"".join(seen) == b"hello\n\xff\x00bytes\n" and term.offset == 14
        term.resize(120, 40)
        deadline = time.monotonic() + 5
        while proc.size != (120, 40):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ValueError):
            term.resize(0, 40)
        assert term.kill()
        assert term.wait() == 137 and term.exited


def test_sdk_create_runs_a_login_shell_by_default(sb: Sandbox, server: Server) -> None:
    with sb.pty.create() as term:
        assert _vm(server, sb.id).processes.procs[term.pid].cmd == LOGIN_SHELL
        term.kill()


def test_sdk_connect_resumes_at_an_offset_and_the_process_outlives_a_close(
    sb: Sandbox,
) -> None:
    term = sb.pty.create(cmd=["cat"])
    term.send_stdin("one\n")
    _read_until(term, b"one\n")
    term.close()
    assert sb.controller.get_process(sb.id, term.pid)["running"]
    with sb.pty.connect(term.pid, offset=term.offset) as again:
        again.send_stdin("two\n")
        assert _read_until(again, b"two\n") == b"two\n"
    with sb.pty.connect(term.pid) as replay:
        assert _read_until(replay, b"two\n") == b"one\ntwo\n"
        assert sb.pty.kill(term.pid)
        assert replay.wait() == 137


def test_sdk_refusals_are_controller_errors(sb: Sandbox) -> None:
    with pytest.raises(ControllerError) as exc:
        sb.pty.connect(999)
    assert exc.value.status == 404
    plain = sb.commands.run(["sleep", "30"], background=True)
    with pytest.raises(ControllerError) as exc:
        sb.pty.connect(plain.pid)
    assert exc.value.status == 400 and "no terminal" in exc.value.message
    assert not sb.pty.kill(999)


# -- flow control ------------------------------------------------------------------


def _handshake(server: Server, path: str) -> socket.socket:
    """A WebSocket opened by hand, so that nothing reads it afterwards."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    key = base64.b64encode(secrets.token_bytes(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {server.token}\r\n\r\n".encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return sock


def test_a_client_that_does_not_read_stops_the_pulling(sb: Sandbox, server: Server) -> None:
    info = sb.controller.start_process(sb.id, ["flood"], pty=(80, 24))
    reads = _vm(server, sb.id).processes.reads
    sock = _handshake(server, _pty_path(sb.id, int(info["pid"])))
    try:
        time.sleep(2.0)  # the socket's buffers fill, and the pulling stops
        stalled_at = len(reads)
        time.sleep(1.5)
        assert len(reads) - stalled_at <= 1, (stalled_at, len(reads))
    finally:
        sock.close()
        sb.controller.signal_process(sb.id, int(info["pid"]), "SIGKILL")


def test_a_sandbox_killed_during_the_session_closes_it_with_4000_plus_the_status(
    sb: Sandbox, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fake guest's read outlives its VM; a real one fails as the VM dies.
    monkeypatch.setattr("forkd.controller.services.terminals.FOLLOW_WAIT_SECS", 0.2)
    term = sb.pty.create(cmd=["cat"])
    term.send_stdin("before\n")
    _read_until(term, b"before\n")
    ctl.kill_sandbox(sb.id)
    with pytest.raises(ControllerError) as closed:
        while term.read(timeout=0.5) is not None:
            pass
    assert closed.value.status == 404 and sb.id in closed.value.message, closed.value
    term.close()


# -- the guard on a bare ASGI WebSocket scope ----------------------------------------


def _ws_scope(token: str | None, extensions: dict[str, Any]) -> dict[str, Any]:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return {
        "type": "websocket",
        "path": "/v1/sandboxes/x/processes/1/pty",
        "headers": headers,
        "query_string": b"",
        "extensions": extensions,
    }


def _guarded(token: str | None, scope: dict[str, Any]) -> tuple[list[Message], bool]:
    """What GuardMiddleware sent for ``scope``, and whether it called the app."""
    sent: list[Message] = []
    called = False

    async def app(_scope: Any, _receive: Any, _send: Any) -> None:
        nonlocal called
        called = True

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(GuardMiddleware(app, token)(scope, receive, send))
    return sent, called


def test_the_guard_closes_a_websocket_before_accepting_it_where_no_http_answer_can_go() -> None:
    sent, called = _guarded("secret", _ws_scope("wrong", {}))
    assert not called
    assert sent == [
        {"type": "websocket.close", "code": 1008, "reason": "missing or wrong bearer token"}
    ]
    sent, called = _guarded("secret", _ws_scope(None, {"websocket.http.response": {}}))
    assert not called and sent[0]["type"] == "websocket.http.response.start"
    assert sent[0]["status"] == 401


def test_the_guard_passes_a_websocket_with_the_token_or_without_auth() -> None:
    assert _guarded("secret", _ws_scope("secret", {})) == ([], True)
    assert _guarded(None, _ws_scope(None, {})) == ([], True)


def test_a_close_reason_is_cut_to_123_bytes_between_characters() -> None:
    assert len(close_reason("é" * 100).encode()) == 122
    assert close_reason("short") == "short"


def test_a_flood_goes_in_large_frames_and_an_echo_at_once(sb: Sandbox, server: Server) -> None:
    asks = _vm(server, sb.id).processes.asks
    with sb.pty.create(cmd=["cat"]) as term:
        term.send_stdin("k")
        assert _read_until(term, b"k") == b"k"
        assert {linger for _max, _min, linger in asks} == {0.0}  # small output: no waiting
        term.kill()
    pid = int(sb.controller.start_process(sb.id, ["flood"], pty=(80, 24))["pid"])
    deadline = time.monotonic() + 10
    while sb.controller.get_process(sb.id, pid)["output_end"] < READ_BYTES:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with sb.pty.connect(pid) as term:  # a full read waits in the ring: four 64 KiB writes
        assert len(term.read(timeout=5) or b"") == READ_BYTES  # in one frame
        term.read(timeout=5)
        assert (READ_BYTES, READ_BYTES, BULK_LINGER_SECS) in asks  # after a bulk answer
        term.kill()


def test_an_open_terminal_does_not_wake_a_paused_sandbox_but_its_keystrokes_do(
    sb: Sandbox, ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(terminals, "FOLLOW_WAIT_SECS", 0.2)  # its reads end and start often

    def state() -> str:  # from the list, which is no use of the sandbox
        return str(next(s for s in ctl.list_sandboxes() if s["id"] == sb.id)["state"])

    with sb.pty.create(cmd=["cat"]) as term:
        term.send_stdin("one\n")
        assert _read_until(term, b"one\n") == b"one\n"
        ctl.pause_sandbox(sb.id)
        time.sleep(1.5)  # the terminal reads on, or would
        assert state() == "paused"
        term.send_stdin("two\n")  # a keystroke is a request: it wakes the sandbox
        assert _read_until(term, b"two\n") == b"two\n"
        assert state() == "running"
        term.kill()
