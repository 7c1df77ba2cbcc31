"""The daemon as the original forkd's clients speak to it, on real VMs: written from its
wire contract (../shared/API.md, and the original's documented shapes), never its code.

REST as its Controller sends it (a bearer token from FORKD_TOKEN, JSON bodies): fork,
branch with ``diff: true`` and ``measure_diff``, compact ``{"to"}``, workspaces
suspended and resumed with their state. The agent protocol at ``guest_addr`` as its
``Sandbox(target=guest_addr, spawn=False)`` speaks it (a connection per request, the
JSON and a newline, the write side closed, the answer read to EOF): ping, exec with
``timeout``, eval; and from inside the sandbox's own namespace, as its postgres recipe
runs ``ip netns exec NS psql -h GUEST``. Its SDK's ``Sandbox()`` through ``forkd fork
--settle-secs`` and ``FORKD_TARGET``. (The MCP tools by the original's names run on real
VMs in tests/integration/test_mcp.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forkd.launcher import free_port
from forkd.vmm.jail import network
from tests.original_forkd import original_call

from .conftest import Daemon

pytestmark = pytest.mark.integration

# The guest's own address as a client inside the namespace dials it: a tiny server on a
# guest port, reached with ip netns exec.
GUEST_SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 5433)); s.listen()\n"
    "c, _ = s.accept(); c.sendall(b'hello from the guest\\n'); c.close()\n"
)
DIAL = (
    "import socket, sys\n"
    "with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as s:\n"
    "    print(s.recv(100).decode().strip())\n"
)


@pytest.fixture(scope="module")
def api(daemon: Daemon) -> Iterator[httpx.Client]:
    """The original Controller's way: FORKD_URL, ``Authorization: Bearer $FORKD_TOKEN``."""
    headers = {"Authorization": f"Bearer {daemon.token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=300) as c:
        yield c


def _spawn(api: httpx.Client, tag: str, n: int = 1) -> list[dict[str, Any]]:
    # The body the original SDK always sends (per_child_netns, prewarm: its defaults).
    r = api.post(
        "/v1/sandboxes",
        json={"snapshot_tag": tag, "n": n, "per_child_netns": False, "prewarm": False},
    )
    assert r.status_code == 201, r.text
    return list(r.json())


def test_fork_diff_branch_measure_compact_and_workspaces(
    api: httpx.Client, api_template: str
) -> None:
    (sb,) = _spawn(api, api_template)
    sid = sb["id"]
    made: list[str] = []
    try:
        r = api.post(
            f"/v1/sandboxes/{sid}/exec",
            json={"args": ["sh", "-c", "echo changed > /tmp/mark"], "timeout_secs": 30},
        )
        assert r.json()["exit_code"] == 0, r.text
        r = api.post(f"/v1/sandboxes/{sid}/branch", json={"tag": "orig-d", "diff": True})
        assert r.status_code == 201, r.text
        made.append("orig-d")
        diff = r.json()
        assert diff["mode"] == "diff" and diff["diff_logical_bytes"] == 256 << 20
        assert 0 < diff["diff_physical_bytes"] < diff["diff_logical_bytes"], diff
        assert isinstance(diff["diff_ms"], int) and isinstance(diff["pause_ms"], int)
        r = api.post(f"/v1/sandboxes/{sid}/branch", json={"tag": "orig-m", "measure_diff": True})
        assert r.status_code == 201, r.text
        made.append("orig-m")
        measured = r.json()
        assert measured["mode"] == "full" and measured["diff_physical_bytes"] > 0, measured
        r = api.post(f"/v1/sandboxes/{sid}/branch", json={"diff": True, "mode": "full"})
        assert r.status_code == 400 and "not both" in r.json()["error"]
        info = api.get(f"/v1/sandboxes/{sid}").json()
        assert info["last_branch_memory_path"] == measured["memory"]

        r = api.post("/v1/snapshots/orig-d/compact", json={"to": "orig-flat"})
        assert r.status_code == 200, r.text
        made.append("orig-flat")
        assert (
            r.json()["mode"] == "full" and api.get("/v1/snapshots/orig-d").json()["mode"] == "diff"
        )
        (kid,) = _spawn(api, "orig-flat")
        r = api.post(f"/v1/sandboxes/{kid['id']}/exec", json={"args": ["cat", "/tmp/mark"]})
        assert r.json()["stdout"] == "changed\n", r.text  # the diff's content, flattened
        assert api.delete(f"/v1/sandboxes/{kid['id']}").status_code == 204

        r = api.post("/v1/workspaces", json={"name": "orig-ws", "snapshot_tag": api_template})
        assert r.status_code == 201, r.text
        ws_sid = r.json()["live_sandbox_id"]
        api.post(f"/v1/sandboxes/{ws_sid}/eval", json={"code": "kept = 'across a suspend'"})
        r = api.post("/v1/workspaces/orig-ws/suspend", json={"diff": False})
        assert r.status_code == 200 and r.json()["status"] == "suspended", r.text
        r = api.post("/v1/workspaces/orig-ws/resume", json={})
        assert r.status_code == 200 and r.json()["live_sandbox_id"] == ws_sid, r.text
        r = api.post(f"/v1/sandboxes/{ws_sid}/eval", json={"code": "kept"})
        assert r.json()["result"] == "'across a suspend'", r.text
        assert api.delete("/v1/workspaces/orig-ws").status_code == 204
        assert api.get(f"/v1/sandboxes/{ws_sid}").status_code == 404
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
        for tag in reversed(made):
            api.delete(f"/v1/snapshots/{tag}")


@pytest.mark.skipif(bool(network.netns_problems()), reason="guest_addr needs network namespaces")
def test_the_agent_protocol_at_guest_addr_and_from_inside_the_namespace(
    api: httpx.Client, api_template: str
) -> None:
    (sb,) = _spawn(api, api_template)
    addr = sb["guest_addr"]
    try:
        pong = original_call(addr, {"action": "ping"})
        assert pong["pong"] is True and pong["agent_lang"] == "python"
        assert pong["warmup_ready"] is True  # the template's warmup ran
        assert isinstance(pong["numpy_version"], str) and "error" not in pong
        # The original SDK's exec sends 'timeout' (not timeout_secs): it is the one obeyed.
        ran = original_call(addr, {"action": "exec", "args": ["echo", "done"], "timeout": 60})
        assert (ran["stdout"], ran["exit_code"]) == ("done\n", 0) and "error" not in ran, ran
        started = time.monotonic()
        cut = original_call(
            addr, {"action": "exec", "args": ["sh", "-c", "echo so far; sleep 20"], "timeout": 1}
        )
        assert (cut["stdout"], cut["exit_code"]) == ("so far\n", 124), cut
        assert time.monotonic() - started < 15  # not the default 30 s
        evaluated = original_call(addr, {"action": "eval", "code": "x + 1"})
        assert evaluated["result"] == "42" and "error" not in evaluated  # its eval raises on one
        failed = original_call(addr, {"action": "eval", "code": "undefined_name"})
        assert failed["error"] == "NameError: name 'undefined_name' is not defined", failed

        # ip netns exec NS client -h GUEST, as the original's postgres recipe does.
        r = api.post(
            f"/v1/sandboxes/{sb['id']}/processes", json={"cmd": ["python3", "-c", GUEST_SERVER]}
        )
        assert r.status_code == 201, r.text
        host = addr.rpartition(":")[0]
        deadline = time.monotonic() + 30
        while True:
            dialed = subprocess.run(
                ["ip", "netns", "exec", sb["netns"], sys.executable, "-c", DIAL, host, "5433"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if dialed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the server is still starting
        assert dialed.stdout.strip() == "hello from the guest", dialed.stderr
    finally:
        api.delete(f"/v1/sandboxes/{sb['id']}")


def test_the_original_sdks_sandbox_through_fork_settle_secs(
    daemon: Daemon, api: httpx.Client, api_template: str
) -> None:
    target = f"127.0.0.1:{free_port()}"
    env = {**daemon.env(), "FORKD_TARGET": target, "FORKD_TAG": api_template}
    before = {s["id"] for s in api.get("/v1/sandboxes").json()}
    # What the original SDK's Sandbox() runs.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "fork",
            "--tag",
            api_template,
            "-n",
            "1",
            "--settle-secs",
            "3600",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # the SDK polls ping until it answers
            try:
                pong = original_call(target, {"action": "ping"})
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.1)
        assert pong["pong"] is True
        assert original_call(target, {"action": "eval", "code": "x + 1"})["result"] == "42"
        ran = original_call(target, {"action": "exec", "args": ["echo", "hi"], "timeout": 30})
        assert ran == {"stdout": "hi\n", "stderr": "", "exit_code": 0}
        (held,) = [s["id"] for s in api.get("/v1/sandboxes").json() if s["id"] not in before]
        proc.send_signal(signal.SIGTERM)  # the SDK's kill()
        assert proc.wait(timeout=10) == 0
        assert api.get(f"/v1/sandboxes/{held}").status_code == 404
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
