"""``forkd fork --settle-secs`` as the original forkd SDK's ``Sandbox()`` runs it: the
real command in a subprocess against the real app (fake VM driver), FORKD_TARGET in
its environment, spoken to in the original agent protocol as that SDK speaks it (a
connection per request, the JSON and a newline, its write side closed, the answer
read to EOF); SIGTERM ends the hold and removes the sandbox."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from forkd.client import Controller
from forkd.launcher import free_port
from tests.original_forkd import original_call
from tests.unit.conftest import Server


def _env(server: Server, target: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    return {**env, "FORKD_URL": server.url, "FORKD_TOKEN": server.token, "FORKD_TARGET": target}


def _sandboxes(server: Server) -> list[str]:
    with Controller(server.url, token=server.token) as ctl:
        return [sb["id"] for sb in ctl.list_sandboxes() if sb["state"] != "dead"]


def _wait_listening(target: tuple[str, int], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            if s.connect_ex(target) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError("forkd fork --settle-secs did not serve FORKD_TARGET")


@pytest.fixture
def template(server: Server) -> str:
    with Controller(server.url, token=server.token) as ctl:
        ctl.create_snapshot("pyagent", memory_mib=128, warmup="x = 41")
    return "pyagent"


@pytest.fixture
def held(server: Server, template: str) -> Iterator[tuple[tuple[str, int], subprocess.Popen[str]]]:
    target = ("127.0.0.1", free_port())
    argv = [
        sys.executable,
        "-m",
        "forkd.cli",
        "fork",
        "--tag",
        template,
        "-n",
        "1",
        "--settle-secs",
        "3600",
    ]
    proc = subprocess.Popen(
        argv,
        env=_env(server, f"{target[0]}:{target[1]}"),
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_listening(target, proc)
        yield target, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_original_sdks_sandbox_speaks_to_a_held_fork(
    server: Server, held: tuple[tuple[str, int], subprocess.Popen[str]]
) -> None:
    target, proc = held
    address = f"{target[0]}:{target[1]}"
    # The relay listens before it forks (a taken port fails at once) and answers once
    # the fork is done: a connection waits in its backlog until then.
    pong = original_call(address, {"action": "ping"})
    assert pong["pong"] is True and "error" not in pong
    (sid,) = _sandboxes(server)
    ran = original_call(
        f"{target[0]}:{target[1]}", {"action": "exec", "args": ["echo", "hi"], "timeout": 60}
    )
    assert (ran["stdout"], ran["exit_code"]) == ("hi\n", 0) and "error" not in ran
    # The original SDK's eval raises on any 'error' key: a success has none.
    evaluated = original_call(address, {"action": "eval", "code": "x + 1"})
    assert evaluated["result"] == "42" and "error" not in evaluated
    failed = original_call(address, {"action": "eval", "code": "nope"})
    assert failed["error"] == "NameError: name 'nope' is not defined", failed
    refused = original_call(address, {"action": "restore"})
    assert "unknown action" in refused["error"]

    # The SDK's kill(): SIGTERM, and 5 s before a SIGKILL.
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - started < 5
    assert sid not in _sandboxes(server)
    assert "removed 1 held sandbox" in proc.stderr.read()  # type: ignore[union-attr]


def test_a_target_that_is_not_local_fails_at_once_saying_so(server: Server, template: str) -> None:
    # The original SDK's default target, not an address of this host: exit 1 at once, the
    # reason on stderr (the SDK shows it), and nothing forked.
    argv = [sys.executable, "-m", "forkd.cli", "fork", "--tag", template, "--settle-secs", "60"]
    proc = subprocess.run(
        argv, env=_env(server, "10.42.0.2:8888"), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    assert "FORKD_TARGET" in proc.stderr and "10.42.0.2:8888" in proc.stderr
    assert _sandboxes(server) == []


def test_a_hold_ends_by_itself_and_its_sandboxes_have_a_timeout(
    server: Server, template: str
) -> None:
    argv = [
        sys.executable,
        "-m",
        "forkd.cli",
        "fork",
        "--tag",
        template,
        "-n",
        "2",
        "--settle-secs",
        "0.5",
        "--json",
    ]
    env = _env(server, "")
    del env["FORKD_TARGET"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    forked = json.loads(proc.stdout)
    assert len(forked) == 2
    assert all(sb["expires_at_unix"] is not None for sb in forked)  # reaped if this is killed
    assert _sandboxes(server) == []


def test_a_held_fork_serves_one_request_per_connection_within_bounds(
    server: Server, held: tuple[tuple[str, int], subprocess.Popen[str]]
) -> None:
    target, _ = held
    with socket.create_connection(target, timeout=5) as sock:
        sock.sendall(b"not json\n")
        answer = json.loads(sock.makefile().readline())
    assert answer["exit_code"] == 1 and "JSON" in answer["error"]
    with socket.create_connection(target, timeout=5) as sock:
        sock.sendall(b'{"action": "exec", "args": "echo hi"}\n')
        assert "'args'" in json.loads(sock.makefile().readline())["error"]
    with pytest.raises(httpx.HTTPError):  # not an HTTP server
        httpx.get(f"http://{target[0]}:{target[1]}/", timeout=10)
