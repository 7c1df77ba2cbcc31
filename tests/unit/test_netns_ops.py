"""Network namespaces made and entered on threads, and rulesets through libnftables.

Real namespaces, links and nftables (root only); no VM. Nothing here touches
the host's own namespace beyond /run/netns entries named ``forkd-test-…``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.errors import VMError
from forkd.vmm.jail import addresses, netns_ops, network
from forkd.vmm.jail.egress import Egress

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or network.netns_problems() != [],
    reason=f"needs root and network namespaces: {network.netns_problems()}",
)


def _my_netns() -> str:
    return os.readlink("/proc/thread-self/ns/net")


@pytest.fixture
def name() -> Iterator[str]:
    made = f"forkd-test-{uuid.uuid4().hex[:8]}"
    yield made
    netns_ops.remove(made)


def _links() -> list[str]:
    return sorted(n for _, n in socket.if_nameindex())


def test_create_makes_an_empty_namespace_and_leaves_the_caller_where_it_was(name: str) -> None:
    before = _my_netns()
    netns_ops.create(name)
    assert (netns_ops.NETNS_DIR / name).exists()
    inside = netns_ops.run_inside(name, lambda: (_my_netns(), _links()))
    assert inside[0] != before
    assert inside[1] == ["lo"]
    assert _my_netns() == before
    assert "lo" in _links() and len(_links()) >= 1


def test_create_refuses_a_name_that_exists(name: str) -> None:
    netns_ops.create(name)
    first = netns_ops.run_inside(name, _my_netns)
    with pytest.raises(FileExistsError):
        netns_ops.create(name)
    assert netns_ops.run_inside(name, _my_netns) == first  # the same namespace


def test_run_inside_hands_the_workers_error_to_the_caller(name: str) -> None:
    netns_ops.create(name)

    def fail() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        netns_ops.run_inside(name, fail)
    with pytest.raises(FileNotFoundError):
        netns_ops.run_inside(name + "-missing", _my_netns)


def test_remove_ends_it_and_a_missing_one_is_nothing(name: str) -> None:
    netns_ops.create(name)
    netns_ops.remove(name)
    assert not (netns_ops.NETNS_DIR / name).exists()
    netns_ops.remove(name)  # again: nothing to do


def test_a_ruleset_lands_in_the_namespace_only(name: str) -> None:
    netns_ops.create(name)
    table = f"forkdtest{uuid.uuid4().hex[:6]}"
    netns_ops.run_inside(name, lambda: netns_ops.load_ruleset(f"table ip {table} {{}}\n", name))
    inside = subprocess.run(
        ["nsenter", f"--net={netns_ops.NETNS_DIR / name}", "--", "nft", "list", "tables"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert f"table ip {table}" in inside
    assert f"table ip {table}" not in host


def test_a_refused_ruleset_names_nftables_complaint(name: str) -> None:
    netns_ops.create(name)
    with pytest.raises(VMError, match=r"nftables refused the rules for here.*syntax"):
        netns_ops.run_inside(name, lambda: netns_ops.load_ruleset("table ip {\n", "here"))


def test_free_index_takes_the_lowest_missing_link(name: str) -> None:
    netns_ops.create(name)
    hn = network.HostNetwork("10.213.0.0/28", "netns")  # 4 slots

    def pick() -> list[int]:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for i in (0, 2):
                ipr.link("add", ifname=f"{addresses.HOST_IF_PREFIX}{i}", kind="veth", peer=f"p{i}")
        picks = [hn._free_index(), hn._free_index(preferred=3), hn._free_index(preferred=2)]
        with IPRoute() as ipr:
            for i in (1, 3):
                ipr.link("add", ifname=f"{addresses.HOST_IF_PREFIX}{i}", kind="veth", peer=f"p{i}")
        try:
            hn._free_index()
        except Exception as exc:  # all four taken
            picks.append(type(exc).__name__)  # type: ignore[arg-type]
        return picks

    assert netns_ops.run_inside(name, pick) == [1, 3, 1, "Unavailable"]


def test_a_vm_namespace_is_made_and_removed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host's own table is left alone here (a daemon may be using it).
    hn = network.HostNetwork("10.214.0.0/24", "netns")
    monkeypatch.setattr(hn, "prepare_host", lambda: None)
    vm_id = f"test-{uuid.uuid4().hex[:8]}"
    net = hn.create(vm_id, Egress.from_internet(False))
    try:
        assert net.netns == addresses.NETNS_PREFIX + vm_id
        assert net.host_if in _links()

        def look() -> tuple[list[str], str, str]:
            v6 = Path("/proc/sys/net/ipv6/conf/all/disable_ipv6").read_text().strip()
            fwd = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
            return _links(), v6, fwd

        links, v6, fwd = netns_ops.run_inside(net.netns, look)
        assert links == sorted(["lo", addresses.NS_VETH, addresses.NS_TAP])
        assert (v6, fwd) == ("1", "1")
    finally:
        network.destroy(net)
    assert not (netns_ops.NETNS_DIR / net.netns).exists()
    deadline = time.monotonic() + 5  # the kernel tears a namespace down in the background
    while net.host_if in _links() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert net.host_if not in _links()  # the veth went with its namespace
