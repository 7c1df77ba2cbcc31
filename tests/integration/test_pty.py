"""Terminals against a real daemon and real VMs: the ``/pty`` WebSocket itself, ``sb.pty``,
and ``forkd shell`` / ``forkd exec -it`` driven under a real pseudo-terminal by pexpect."""

from __future__ import annotations

import json
import statistics
import sys
import time

import httpx
import pexpect
import pytest
import wsproto.events
from httpx_ws import WebSocketDisconnect, WebSocketSession, WebSocketUpgradeError, connect_ws

from forkd.client import Controller, Sandbox
from forkd.client.pty import PtyHandle

from .conftest import Daemon

pytestmark = pytest.mark.integration


def _pty_url(daemon: Daemon, sandbox_id: str, pid: int) -> str:
    return f"{daemon.url}/v1/sandboxes/{sandbox_id}/processes/{pid}/pty"


def _bytes_until(ws: WebSocketSession, wanted: bytes, timeout: float = 30) -> bytes:
    """Binary frames from ``ws`` until ``wanted`` shows in them."""
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {wanted!r} in {seen[-300:]!r}"
        event = ws.receive(timeout=left)
        assert isinstance(event, wsproto.events.BytesMessage), event
        seen += bytes(event.data)
    return seen


def _pty_until(term: PtyHandle, wanted: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        assert time.monotonic() < deadline, f"never saw {wanted!r} in {seen[-300:]!r}"
        piece = term.read(timeout=1)
        assert piece is not None, f"the shell exited before {wanted!r}: {seen[-300:]!r}"
        seen += piece
    return seen


# -- the WebSocket route itself ------------------------------------------------------


def test_the_socket_refuses_a_missing_or_wrong_token(
    daemon: Daemon, sb: Sandbox, ctl: Controller
) -> None:
    pid = int(ctl.start_process(sb.id, ["sh"], pty=(80, 24))["pid"])
    # The audit log keeps 10 401s a second per address: start in a second of our own,
    # not one an earlier test (the API fuzz) may have spent.
    time.sleep(1.01 - time.time() % 1)
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        with (
            httpx.Client(headers=headers, timeout=30) as client,
            pytest.raises(WebSocketUpgradeError) as refused,
            connect_ws(_pty_url(daemon, sb.id, pid), client),
        ):
            pass
        assert refused.value.response.status_code == 401
    # The daemon writes each record once the refusal is sent: give the second a moment.
    deadline = time.monotonic() + 5
    while True:
        log = (daemon.state_dir / "audit.log").read_text().splitlines()
        mine = [r for r in map(json.loads, log) if r.get("websocket") and r["sandbox_id"] == sb.id]
        if len(mine) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [r["status"] for r in mine[-2:]] == [401, 401]
    ctl.signal_process(sb.id, pid, "SIGKILL")


def test_the_socket_echoes_resizes_and_ends_with_the_exit_frame(
    daemon: Daemon, sb: Sandbox, ctl: Controller
) -> None:
    pid = int(ctl.start_process(sb.id, ["sh"], pty=(100, 30))["pid"])
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with (
        httpx.Client(headers=headers, timeout=30) as client,
        # session_class: the default, named for mypy to know the session's type
        connect_ws(_pty_url(daemon, sb.id, pid), client, session_class=WebSocketSession) as ws,
    ):
        ws.send_bytes(b"echo sum-$((40+2)); stty size\n")
        assert b"sum-42" in _bytes_until(ws, b"30 100")
        ws.send_text(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        ws.send_bytes(b"stty size\n")
        _bytes_until(ws, b"40 120")
        ws.send_bytes(b"exit 5\n")
        while True:
            event = ws.receive(timeout=30)
            if isinstance(event, wsproto.events.TextMessage):
                break
        assert json.loads(event.data) == {"type": "exit", "exit_code": 5}
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive(timeout=30)
        assert closed.value.code == 1000
    assert ctl.get_process(sb.id, pid)["exit_code"] == 5


def test_a_process_without_a_terminal_is_refused(daemon: Daemon, sb: Sandbox) -> None:
    plain = sb.commands.run(["sleep", "60"], background=True)
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with (
        httpx.Client(headers=headers, timeout=30) as client,
        pytest.raises(WebSocketUpgradeError) as refused,
        connect_ws(_pty_url(daemon, sb.id, plain.pid), client),
    ):
        pass
    assert refused.value.response.status_code == 400
    plain.kill()


# -- sb.pty ------------------------------------------------------------------------


def test_sdk_pty_shell_size_exit_code_and_reconnect(sb: Sandbox) -> None:
    with sb.pty.create(cols=100, rows=30) as term:
        term.send_stdin("stty size\n")
        _pty_until(term, b"30 100")
        term.close()  # the shell runs on
        with sb.pty.connect(term.pid, offset=term.offset) as again:
            again.resize(120, 40)
            again.send_stdin("stty size; exit 3\n")
            rest = _pty_until(again, b"40 120")
            assert again.wait() == 3
        assert rest and sb.controller.get_process(sb.id, term.pid)["exit_code"] == 3


def test_keystroke_echo_round_trip(sb: Sandbox) -> None:
    """Typing one key and reading its echo back, through the daemon and the guest's pty."""
    with sb.pty.create(cmd=["cat"]) as term:
        samples = []
        for ch in "abcdefghijklmnopqrst":
            t0 = time.monotonic()
            term.send_stdin(ch)
            _pty_until(term, ch.encode(), timeout=10)
            samples.append((time.monotonic() - t0) * 1000)
        term.kill()
    p50 = statistics.median(samples)
    print(f"\nkeystroke echo round trip: p50 {p50:.1f} ms, max {max(samples):.1f} ms")
    assert p50 < 2000  # a loose bound: TCG on a shared machine; the number is the report


# -- forkd shell and forkd exec -it under a real pseudo-terminal -----------------------


def _spawn(daemon: Daemon, *args: str) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "forkd.cli", *args],
        env=daemon.env(),
        dimensions=(24, 80),
        timeout=60,
    )


def test_forkd_shell_types_reads_resizes_and_exits_with_the_code(
    daemon: Daemon, sb: Sandbox
) -> None:
    child = _spawn(daemon, "shell", sb.id)
    try:
        child.send("echo answer-$((6*7)); stty size\r")  # typed ahead of the prompt
        child.expect_exact("answer-42")
        child.expect_exact("24 80")
        child.setwinsize(40, 120)  # SIGWINCH to forkd shell
        time.sleep(0.5)  # its resize reaches the guest's terminal before the next line
        child.send("stty size\r")
        child.expect_exact("40 120")
        child.send("sleep 100\r")
        time.sleep(1)
        child.send("\x03")  # Ctrl-C: to the guest's sleep, not to forkd
        child.send("echo still-$((1+1))\r")
        child.expect_exact("still-2")
        child.send("exit 4\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 4


def test_forkd_exec_it_returns_the_remote_exit_code(daemon: Daemon, sb: Sandbox) -> None:
    child = _spawn(daemon, "exec", "-it", sb.id, "--", "sh", "-c", "exit 3")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 3
