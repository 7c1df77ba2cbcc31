"""Network isolation, tried from inside real sandboxes as a hostile guest would.

Each sandbox has its own network namespace. From a guest we try every
address of the host (on the daemon's port and on a listener of the test),
a sibling sandbox, and an "outside" host that this test builds in a
namespace of its own (198.51.100.0/24, plus a link-local and a private
address routed to it), under each egress policy. No packet leaves for any
address this test did not create.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.vmm.jail import addresses, network
from tests.egress_world import clash, link_to

from .conftest import Daemon

pytestmark = pytest.mark.integration

if network.netns_problems():
    pytest.skip(
        "no network namespaces here: " + "; ".join(network.netns_problems()),
        allow_module_level=True,
    )

OUTSIDE = "198.51.100.1"  # the fake internet host (TEST-NET-2, inside our namespace)
OUTSIDE_2 = "198.51.100.2"
# The host's "LAN" (TEST-NET-3, a range no host here is on: the fixture checks): the host
# is attached to it, and our namespace is the neighbour there that routes to the fake
# internet (a gateway, as a LAN has). Every route to it names the test's own link.
LAN = "203.0.113.0/24"
LAN_HOST = "203.0.113.254"
LAN_GATEWAY = "203.0.113.1"
METADATA = "169.254.169.254"
PRIVATE = "10.99.0.1"
PORT = 18080

# Run in the guest: try each host:port at once; print what happened to each. A target
# is "open" only when something answered from there: the daemon's egress proxy takes
# every connection the guest opens and closes those it refuses ("closed"). Bytes that
# are neither TLS nor HTTP go first (the proxy judges them by address alone, as it
# does a raw TCP client's), so a server that waits for a request (the daemon's API)
# answers them too (a 400).
PROBE = """
import json, socket, sys, threading
out = {}
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
        s.settimeout(5)
        s.sendall(b"hello?\\r\\n\\r\\n")
        out[target] = "open" if s.recv(100) else "closed"
        s.close()
    except ConnectionRefusedError:
        out[target] = "refused"
    except OSError as e:
        out[target] = type(e).__name__
ts = [threading.Thread(target=probe, args=(t,)) for t in sys.argv[1:]]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"""

LISTEN = (
    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
    "s.bind(('0.0.0.0', {port})); s.listen(16)\n"
    "while True: c, a = s.accept(); c.sendall(b'hello from the guest'); c.close()"
)


def _api(daemon: Daemon) -> httpx.Client:
    return httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=120
    )


def _fork(api: httpx.Client, **body: Any) -> dict[str, Any]:
    r = api.post("/v1/sandboxes", json={"snapshot_tag": "py", **body})
    assert r.status_code == 201, r.text
    return r.json()[0]


def _probe(api: httpx.Client, sandbox_id: str, targets: list[str]) -> dict[str, str]:
    r = api.post(
        f"/v1/sandboxes/{sandbox_id}/exec",
        json={"args": ["python3", "-c", PROBE, *targets], "timeout_secs": 60},
    )
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return json.loads(r.json()["stdout"])


class Listener:
    """A TCP listener of the test on the host, counting who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, addr = self.sock.accept()
                self.peers.append(addr[0])
                conn.close()


def _agent_ping(guest_addr: str) -> dict[str, Any]:
    """The guest agent's answer on its TCP port (what only the host can reach)."""
    host, port = guest_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b'{"action": "ping"}\n')
        return json.loads(s.makefile().readline())


def _host_addresses() -> list[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return sorted({a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=socket.AF_INET)})


@pytest.fixture(scope="module")
def outside() -> Iterator[str]:
    """A fake outside host in a namespace of its own, listening on PORT at every address:
    one hop away from the host, through the "LAN" the host is attached to."""
    from pyroute2 import NetNS, netns

    name = f"fkt-out-{os.getpid()}"
    host_if = f"fkt{os.getpid() % 100000}"
    if (taken := clash(LAN, "198.51.100.0/24")) is not None:
        pytest.skip(f"this host is on {taken}: the test's fake LAN and internet would clash")
    netns.create(name)
    listeners: list[subprocess.Popen[bytes]] = []
    stack = contextlib.ExitStack()
    try:
        # METADATA and PRIVATE too: reachable only through this test's namespace
        routes = ["198.51.100.0/24", f"{METADATA}/32", f"{PRIVATE}/32"]
        stack.enter_context(link_to(name, host_if, LAN_HOST, LAN_GATEWAY, routes))
        with NetNS(name) as ns:
            eth = ns.link_lookup(ifname="eth0")[0]
            ns.addr("add", index=eth, address=LAN_GATEWAY, prefixlen=24)
            for addr in (OUTSIDE, OUTSIDE_2, METADATA, PRIVATE):
                ns.addr("add", index=eth, address=addr, prefixlen=32)
            ns.link("set", index=eth, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=LAN_HOST)
        listeners.append(
            subprocess.Popen(
                [
                    "nsenter",
                    f"--net={network.NETNS_DIR / name}",
                    "--",
                    sys.executable,
                    "-c",
                    LISTEN.format(port=PORT),
                ],
            )
        )
        yield name
    finally:
        for proc in listeners:
            proc.kill()
            proc.wait()
        stack.close()
        netns.remove(name)


def test_sandbox_has_its_own_namespace_and_address(daemon: Daemon, api_template: str) -> None:
    with _api(daemon) as api:
        sb = _fork(api, per_child_netns=True)  # what original forkd clients send
        try:
            assert sb["netns"] == f"forkd-{sb['id']}"
            assert Path("/run/netns", sb["netns"]).exists()
            assert sb["guest_addr"].endswith(":8888")
            # The host reaches the guest's agent there.
            assert _agent_ping(sb["guest_addr"])["pong"] is True
        finally:
            api.delete(f"/v1/sandboxes/{sb['id']}")
        assert not Path("/run/netns", sb["netns"]).exists()  # no leak


def test_a_guest_reaches_no_host_address_and_no_sibling(daemon: Daemon, api_template: str) -> None:
    listener = Listener()
    with _api(daemon) as api:
        a = _fork(api, egress="internet")  # the widest policy: still fenced in
        b = _fork(api)
        try:
            addrs = [*_host_addresses(), addresses.GATEWAY_IP, addresses.DNS_IP]
            targets = [f"{h}:{p}" for h in addrs for p in (daemon.port, listener.port, 22)]
            b_host = b["guest_addr"].rsplit(":", 1)[0]
            targets += [b["guest_addr"], f"{b_host}:{listener.port}"]
            results = _probe(api, a["id"], targets)
            assert set(results) == set(targets)
            reached = {t: r for t, r in results.items() if r == "open"}
            assert not reached, f"a sandbox reached {reached}"
            assert listener.peers == []
            # The sibling's agent listens: the host itself reaches it.
            assert _agent_ping(b["guest_addr"])["pong"] is True
        finally:
            for sb in (a, b):
                api.delete(f"/v1/sandboxes/{sb['id']}")


@pytest.mark.parametrize(
    ("egress", "reachable"),
    [
        ("none", set()),
        ("internet", {OUTSIDE, OUTSIDE_2}),
        ({"allow": [f"{OUTSIDE}/32", PRIVATE]}, {OUTSIDE, PRIVATE}),
        # never metadata, nor the host's own networks (its LAN, its gateway, its address
        # there): issue 35 found SYNs to a LAN's gateway and the host's address passing
        ({"allow": [METADATA, "0.0.0.0/0", LAN]}, {OUTSIDE, OUTSIDE_2, PRIVATE}),
    ],
)
def test_egress_policy_decides_what_the_outside_world_sees(
    daemon: Daemon, api_template: str, outside: str, egress: Any, reachable: set[str]
) -> None:
    hosts = (OUTSIDE, OUTSIDE_2, METADATA, PRIVATE, LAN_GATEWAY, LAN_HOST)
    targets = {h: f"{h}:{PORT}" for h in hosts}
    with _api(daemon) as api:
        sb = _fork(api, egress=egress)
        try:
            results = _probe(api, sb["id"], list(targets.values()))
        finally:
            api.delete(f"/v1/sandboxes/{sb['id']}")
    opened = {h for h, t in targets.items() if results[t] == "open"}
    assert opened == reachable, results


def test_the_user_mode_fallback_reaches_nothing(image: Any, tmp_path_factory: Any) -> None:
    # Without namespaces the daemon falls back to QEMU's NAT, whose 10.0.2.2 is
    # the host itself: that fallback must have no egress at all.
    root = Path(tempfile.mkdtemp(prefix="forkd-u-", dir="/tmp"))
    d = Daemon(root)
    listener = Listener()
    d.start("--network", "user", "--kill-on-exit", "--pool-size", "0")
    try:
        with _api(d) as api:
            r = api.post("/v1/snapshots", json={"tag": "py", "memory_mib": 256}, timeout=300)
            assert r.status_code == 201, r.text
            sb = _fork(api, egress="internet")
            assert sb["netns"] is None and sb["guest_addr"] is None
            targets = [f"10.0.2.2:{listener.port}", f"10.0.2.2:{d.port}", f"{OUTSIDE}:{PORT}"]
            results = _probe(api, sb["id"], targets)
            assert all(v != "open" for v in results.values()), results
            assert listener.peers == []
            r = api.post("/v1/sandboxes", json={"snapshot_tag": "py", "per_child_netns": True})
            assert r.status_code == 503 and "namespaces" in r.json()["error"]
    finally:
        d.stop()
        d.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)
