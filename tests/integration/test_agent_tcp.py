"""The guest agent's TCP port 8888, reached from the host at a sandbox's guest_addr.

Real sandboxes forked through a real daemon that runs as root, so each has
its own network namespace. The agent listens from the template's boot on;
every fork is a memory copy, so its listener is the template's, restored.
Traffic goes only to addresses inside namespaces the daemon made for this
test's sandboxes.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from typing import Any

import httpx
import pytest

from forkd.client import ControllerError, GuestAgent
from forkd.vmm.jail import network

from .conftest import Daemon

pytestmark = pytest.mark.integration

if network.netns_problems():
    pytest.skip(
        "no network namespaces here (guest_addr needs them): "
        + "; ".join(network.netns_problems()),
        allow_module_level=True,
    )

# Run in a guest: send a ping to each host:port; print whose agent answered.
PING_FROM_GUEST = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as s:
            s.sendall(b'{"action": "ping"}\\n')
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        out[target] = json.loads(data)["hostname"]
    except OSError as e:
        out[target] = "unreachable: " + type(e).__name__
print(json.dumps(out))
"""


def _api(daemon: Daemon) -> httpx.Client:
    return httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=120
    )


def _fork(api: httpx.Client, tag: str = "py", n: int = 1) -> list[dict[str, Any]]:
    r = api.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": n})
    assert r.status_code == 201, r.text
    return r.json()


def _call(api: httpx.Client, sandbox_id: str, what: str, **body: Any) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{sandbox_id}/{what}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _tcp(guest_addr: str, request: bytes, timeout: float = 30) -> dict[str, Any]:
    """The protocol by hand: one line out, read to EOF, exactly one line back."""
    host, port = guest_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(1 << 20):
            data += chunk
    assert data.endswith(b"\n") and data.count(b"\n") == 1, data[:300]
    return json.loads(data)


def test_host_reaches_a_forks_agent_at_guest_addr(daemon: Daemon, api_template: str) -> None:
    with _api(daemon) as api:
        (sb,) = _fork(api)
        try:
            addr = sb["guest_addr"]
            assert addr.endswith(":8888")
            pong = _tcp(addr, b'{"action": "ping"}\n')
            over_http = _call(api, sb["id"], "ping")
            assert pong["ok"] is True and pong["pong"] is True
            # The same agent process as the serial channel's, started at the
            # template's boot: the listener came with the fork's memory.
            assert (pong["pid"], pong["hostname"]) == (over_http["pid"], over_http["hostname"])

            ran = _tcp(addr, b'{"action": "exec", "args": ["python3", "-c", "print(2+2)"]}\n')
            assert (ran["ok"], ran["stdout"], ran["exit_code"], ran["timed_out"]) == (
                True,
                "4\n",
                0,
                False,
            )
            evaluated = _tcp(addr, b'{"action": "eval", "code": "x + 1"}\n')  # warmup: x = 41
            assert evaluated["result"] == "42" and "error" not in evaluated  # as the original
            assert _tcp(addr, b'{"action": "restore"}\n') == {
                "ok": False,
                "error": "unknown action: 'restore' (expected one of ping, exec, eval)",
            }

            agent = GuestAgent(addr)
            tcp_ms = _median_ms(agent.ping)
            http_ms = _median_ms(lambda: _call(api, sb["id"], "ping"))
            print(f"\nping p50: TCP {tcp_ms:.2f} ms, HTTP through the daemon {http_ms:.2f} ms")
        finally:
            api.delete(f"/v1/sandboxes/{sb['id']}")


def _median_ms(call: Any, rounds: int = 20) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def test_eval_state_is_shared_between_http_and_tcp(daemon: Daemon, api_template: str) -> None:
    with _api(daemon) as api:
        (sb,) = _fork(api)
        branch_tag = None
        grandchild = None
        try:
            agent = GuestAgent(sb["guest_addr"])
            _call(api, sb["id"], "eval", code="from_http = 'set over HTTP'")
            assert agent.eval("from_http").result == "'set over HTTP'"
            assert agent.eval("from_tcp = 7").ok
            assert _call(api, sb["id"], "eval", code="from_tcp * 6")["result"] == "42"

            # A fork of a branch of it: a restored copy of that state, and of the listener.
            r = api.post(f"/v1/sandboxes/{sb['id']}/branch", json={})
            assert r.status_code == 201, r.text
            branch_tag = r.json()["tag"]
            (grandchild,) = _fork(api, branch_tag)
            assert grandchild["guest_addr"] != sb["guest_addr"]
            assert GuestAgent(grandchild["guest_addr"]).eval("from_tcp, from_http").result == (
                "(7, 'set over HTTP')"
            )
        finally:
            for child in (grandchild, sb):
                if child is not None:
                    api.delete(f"/v1/sandboxes/{child['id']}")
            if branch_tag is not None:
                api.delete(f"/v1/snapshots/{branch_tag}")


def test_a_sibling_reaches_only_its_own_agent(daemon: Daemon, api_template: str) -> None:
    with _api(daemon) as api:
        a, b = _fork(api, n=2)
        try:
            names = {sb["id"]: GuestAgent(sb["guest_addr"]).ping()["hostname"] for sb in (a, b)}
            assert len(set(names.values())) == 2
            # From inside b: a's guest_addr is fenced off; 10.0.2.15 is every
            # guest's own address, so it (like loopback) is b's own agent.
            targets = [a["guest_addr"], "10.0.2.15:8888", "127.0.0.1:8888"]
            ran = _call(
                api,
                b["id"],
                "exec",
                args=["python3", "-c", PING_FROM_GUEST, *targets],
                timeout_secs=60,
            )
            assert ran["exit_code"] == 0, ran
            seen = json.loads(ran["stdout"])
            assert seen[a["guest_addr"]].startswith("unreachable"), seen
            assert seen["10.0.2.15:8888"] == names[b["id"]]
            assert seen["127.0.0.1:8888"] == names[b["id"]]
        finally:
            for sb in (a, b):
                api.delete(f"/v1/sandboxes/{sb['id']}")


def test_silent_tcp_clients_wedge_neither_agent_nor_serial_channel(
    daemon: Daemon, api_template: str
) -> None:
    with _api(daemon) as api:
        (sb,) = _fork(api)
        host, port = sb["guest_addr"].rsplit(":", 1)
        holders: list[socket.socket] = []
        try:
            holders = [socket.create_connection((host, int(port)), timeout=10) for _ in range(16)]
            # Accepted in the order they came: the 17th finds no slot.
            with socket.create_connection((host, int(port)), timeout=10) as extra:
                data = extra.recv(4096)
            assert json.loads(data) == {"ok": False, "error": "too many connections (at most 16)"}
            start = time.monotonic()
            assert _call(api, sb["id"], "ping")["pong"] is True  # the serial channel answers
            assert time.monotonic() - start < 2
            # The agent answers silent clients after 5 s and frees their slots.
            for sock in holders:
                answer = json.loads(sock.recv(4096))
                assert answer["error"] == "no complete request within 5 s"
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert GuestAgent(sb["guest_addr"]).ping()["pong"] is True
                    break
                except ControllerError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
        finally:
            for sock in holders:
                sock.close()
            api.delete(f"/v1/sandboxes/{sb['id']}")
