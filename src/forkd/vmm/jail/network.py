"""Each VM's own network namespace, and the host rules that fence them all in.

Every VM (template or fork) runs QEMU inside a namespace of its own::

    host                         namespace forkd-<vm id>          guest
    fkh-<n> 10.201.x.1/30 ─veth─ veth0 10.201.x.2/30
                                 tap0   10.0.2.2/24  ─── QEMU ─── eth0 10.0.2.15

Every guest has the same address (children are memory copies of one
guest); the namespace keeps the copies apart. The host reaches a guest's
agent at ``10.201.x.2:8888``, and any other TCP port of the guest at the same
address (DNAT inside the namespace; namespaces made before forkd proxied
ports forward only 8888). What the guest may
reach is the namespace's ``egress`` chain (:mod:`forkd.vmm.jail.egress`); the
host's ``forkd`` table drops anything a sandbox sends to the host itself or
to another sandbox, whatever the policy.

Namespaces are made and entered on short-lived threads (:mod:`forkd.vmm.jail.netns_ops`),
links with pyroute2; filtering and NAT are nftables rulesets
(:mod:`forkd.vmm.jail.rulesets`), each loaded whole through libnftables. The
addresses and names above, the same in every namespace, are
:mod:`forkd.vmm.jail.addresses`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from forkd.errors import Unavailable, VMError
from forkd.vmm.jail import netns_ops
from forkd.vmm.jail.addresses import (
    AGENT_PORT,
    DEFAULT_CIDR,
    DNS_IP,
    GATEWAY_IP,
    HOST_IF_PREFIX,
    NETNS_PREFIX,
    NS_TAP,
    NS_VETH,
    PROXY_PORT,
    TAP_MAC,
)
from forkd.vmm.jail.egress import Egress
from forkd.vmm.jail.rulesets import host_ruleset, inside_clients_ruleset, namespace_ruleset

log = logging.getLogger(__name__)

NETNS_DIR = netns_ops.NETNS_DIR
HOST_RELOAD_SECS = 5.0  # the host table is loaded again at most this often
HOST_LOCK = Path("/run/forkd-network.lock")


def _link_exists(index: int) -> bool:
    """Whether this namespace has the host-side link of /30 ``index``."""
    try:
        socket.if_nametoindex(f"{HOST_IF_PREFIX}{index}")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Host-wide: two daemons never allocate the same /30 or interface name."""
    NETNS_DIR.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(HOST_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SandboxNet:
    """One VM's namespace and its addresses."""

    netns: str
    host_if: str
    host_ip: str
    ns_ip: str

    @property
    def index(self) -> int | None:
        """Its /30's place in the sandbox range (from the host-side name)."""
        suffix = self.host_if[len(HOST_IF_PREFIX) :]
        return int(suffix) if suffix.isdigit() else None

    @property
    def guest_addr(self) -> str:
        """Where the host reaches the guest's agent port."""
        return f"{self.ns_ip}:{AGENT_PORT}"

    def to_json(self) -> dict[str, str]:
        return {
            "netns": self.netns,
            "host_if": self.host_if,
            "host_ip": self.host_ip,
            "ns_ip": self.ns_ip,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxNet:
        return cls(
            str(data["netns"]), str(data["host_if"]), str(data["host_ip"]), str(data["ns_ip"])
        )


def _load_rules(ruleset: str, where: str, *, inside: bool) -> None:
    """Turn forwarding on and load ``ruleset`` in the calling thread's namespace:
    the host's, or (``inside``) a VM's, where IPv6 is also switched off."""
    netns_ops.write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")
    if inside:
        # Nothing in a VM's namespace speaks IPv6: no neighbour discovery or
        # router advertisements for a guest to play with.
        for conf in ("all", "default"):
            netns_ops.write_sysctl(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "1")
    netns_ops.load_ruleset(ruleset, where)


def upstream_resolver(resolv_conf: Path = Path("/etc/resolv.conf")) -> str | None:
    """The host's first nameserver a namespace can reach (not a loopback one)."""
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.ip_address(parts[1])
            except ValueError:
                continue
            if addr.version == 4 and not addr.is_loopback:
                return str(addr)
    return None


def host_networks(
    sandbox_cidr: ipaddress.IPv4Network, opened: tuple[ipaddress.IPv4Network, ...] = ()
) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host is directly attached to, and its own addresses, but
    loopback, the sandboxes' own range and those the operator ``opened``: where a
    sandbox's packets would reach the host's neighbours (its gateway, its LAN, a
    bridge of containers) or the host itself, whatever private ranges a policy shuts."""
    from pyroute2 import IPRoute

    found: set[ipaddress.IPv4Network] = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            prefix = msg["prefixlen"]
            # IFA_LOCAL is the host's own address; IFA_ADDRESS the peer's on a
            # point-to-point link (the same address elsewhere).
            for address in {msg.get_attr("IFA_LOCAL"), msg.get_attr("IFA_ADDRESS")} - {None}:
                iface = ipaddress.IPv4Interface(f"{address}/{prefix}")
                if iface.ip.is_loopback or iface.ip in sandbox_cidr:
                    continue
                found.update((iface.network, ipaddress.IPv4Network(f"{iface.ip}/32")))
    return sorted(set(_without(found, opened)))


def _without(
    nets: set[ipaddress.IPv4Network], opened: tuple[ipaddress.IPv4Network, ...]
) -> list[ipaddress.IPv4Network]:
    """``nets`` less the ranges in ``opened`` (a /32 opened in a /24 leaves the /24's rest)."""
    left = list(nets)
    for hole in opened:
        cut: list[ipaddress.IPv4Network] = []
        for net in left:
            if net.subnet_of(hole):
                continue
            cut.extend(net.address_exclude(hole) if hole.subnet_of(net) else [net])
        left = cut
    return left


class EgressListener(Protocol):
    """What serves a namespace's guest connections (the daemon's egress proxy)."""

    async def attach(
        self, net: SandboxNet, vm_id: str, policy: Egress, host_nets: list[ipaddress.IPv4Network]
    ) -> None: ...

    def release(self, netns: str) -> None: ...


# The listeners of this process: each lets a namespace go before it is removed (a
# socket of its inside would keep the namespace, and its veth, alive).
_listeners: list[EgressListener] = []


class HostNetwork:
    """The daemon's view of sandbox networking: mode, address pool, namespaces."""

    def __init__(
        self, cidr: str = DEFAULT_CIDR, mode: str = "auto", opened: tuple[str, ...] = ()
    ) -> None:
        try:
            self.cidr = ipaddress.IPv4Network(cidr)
        except ValueError as exc:
            raise VMError(f"--sandbox-cidr {cidr!r} is not an IPv4 network: {exc}") from exc
        try:  # the host's own networks sandboxes may reach (--egress-host-network)
            self.opened = tuple(ipaddress.IPv4Network(n, strict=False) for n in opened)
        except ValueError as exc:
            raise VMError(f"--egress-host-network: not an IPv4 network: {exc}") from exc
        if self.cidr.prefixlen > 29:
            raise VMError(f"--sandbox-cidr {cidr} is too small: it needs room for /30s")
        self.mode, self.reason = self._choose(mode)
        self._lock = threading.Lock()
        self._host_loaded_at: float | None = None
        self.resolver = upstream_resolver()
        # vm id -> the /30 it should get if free: a woken sandbox keeps its address.
        self._preferred: dict[str, int] = {}
        self.egress: EgressListener | None = None  # None: the kernel decides by address

    def use_egress(self, listener: EgressListener | None) -> None:
        """Send every guest's TCP through ``listener`` (None: by address, no proxy)."""
        if self.egress is not None and self.egress in _listeners:
            _listeners.remove(self.egress)
        self.egress = listener
        if listener is not None:
            _listeners.append(listener)

    def host_nets(self) -> list[ipaddress.IPv4Network]:
        """The host's networks a sandbox never reaches (:func:`host_networks`), now."""
        return host_networks(self.cidr, self.opened)

    @staticmethod
    def _choose(mode: str) -> tuple[str, str]:
        problems = netns_problems()
        if mode == "user":
            return "user", "asked for user-mode networking"
        if not problems:
            return "netns", "a network namespace per VM (root, nftables, pyroute2)"
        if mode == "netns":
            raise Unavailable("network namespaces are not available: " + "; ".join(problems))
        return "user", "user-mode networking without egress: " + "; ".join(problems)

    @property
    def enabled(self) -> bool:
        return self.mode == "netns"

    def prefer(self, vm_id: str, index: int) -> None:
        """Give ``vm_id``'s next namespace the /30 ``index`` when it is free."""
        self._preferred[vm_id] = index

    def prepare_host(self) -> None:
        """Load the host's ``forkd`` table and let it forward sandbox traffic.

        Loaded again every few seconds (at the next VM start): a host firewall
        reload (``nft flush ruleset``) must not leave the sandboxes unfenced.
        """
        now = time.monotonic()
        if self._host_loaded_at is not None and now - self._host_loaded_at < HOST_RELOAD_SECS:
            return
        _load_rules(host_ruleset(str(self.cidr), os.geteuid()), "the host", inside=False)
        self._host_loaded_at = now

    # ------------------------------------------------------------ per VM

    def create(
        self, vm_id: str, egress: Egress, host_nets: list[ipaddress.IPv4Network] | None = None
    ) -> SandboxNet:
        """Make ``vm_id``'s namespace, links and rules; all or nothing."""
        from pyroute2 import IPRoute

        self.prepare_host()
        # Hostnames resolved and the host's networks listed now, no lock held.
        if host_nets is None:
            host_nets = self.host_nets()
        port = PROXY_PORT if self.egress is not None else None
        rules = namespace_ruleset(egress, self.resolver, host_nets, port)
        name = NETNS_PREFIX + vm_id
        # One allocation at a time on this host, whichever daemon or thread asks:
        # the host-side link's name claims the /30. The namespace's inside is set
        # up after the lock is let go.
        try:
            with self._lock, _host_lock():
                index = self._free_index(self._preferred.pop(vm_id, None))
                host_ip = str(self.cidr.network_address + 4 * index + 1)
                ns_ip = str(self.cidr.network_address + 4 * index + 2)
                net = SandboxNet(name, f"{HOST_IF_PREFIX}{index}", host_ip, ns_ip)
                remove_namespace(name)  # a leftover of a crash: this id is ours
                netns_ops.create(name)
                with IPRoute() as ipr:
                    ipr.link(
                        "add",
                        ifname=net.host_if,
                        kind="veth",
                        peer={"ifname": NS_VETH, "net_ns_fd": name},
                    )
                    idx = ipr.link_lookup(ifname=net.host_if)[0]
                    ipr.addr("add", index=idx, address=host_ip, prefixlen=30)
                    ipr.link("set", index=idx, state="up")
            rules += inside_clients_ruleset(net.ns_ip)
            netns_ops.run_inside(name, lambda: self._inside(net, rules))
        except BaseException:
            # The veth is ours only if it landed in our namespace: removing the
            # namespace removes it; a name clash never deletes another's.
            remove_namespace(name)
            raise
        return net

    def reload(self, net: SandboxNet, egress: Egress) -> None:
        """Load ``net``'s namespace rules again for a new policy (DNS opens or shuts with
        it; a policy that lets nothing out redirects nothing to the proxy)."""
        port = PROXY_PORT if self.egress is not None else None
        rules = namespace_ruleset(egress, self.resolver, self.host_nets(), port)
        rules += inside_clients_ruleset(net.ns_ip)
        netns_ops.run_inside(net.netns, lambda: netns_ops.load_ruleset(rules, net.netns))

    @staticmethod
    def _inside(net: SandboxNet, rules: str) -> None:
        """The namespace's side (run on a thread inside it): links, route, rules."""
        from pyroute2 import IPRoute

        with IPRoute() as ns:
            veth = ns.link_lookup(ifname=NS_VETH)[0]
            ns.addr("add", index=veth, address=net.ns_ip, prefixlen=30)
            ns.link("set", index=veth, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            ns.link("add", ifname=NS_TAP, kind="tuntap", mode="tap")
            tap = ns.link_lookup(ifname=NS_TAP)[0]
            ns.link("set", index=tap, address=TAP_MAC)
            ns.addr("add", index=tap, address=GATEWAY_IP, prefixlen=24)
            # The guest's resolver: an address of the namespace's, so its ARP for it
            # is answered (without it no query ever left the guest).
            ns.addr("add", index=tap, address=DNS_IP, prefixlen=32)
            ns.link("set", index=tap, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=net.host_ip)
        _load_rules(rules, f"namespace {net.netns}", inside=True)

    def _free_index(self, preferred: int | None = None) -> int:
        """The lowest /30 whose host-side link does not exist (``preferred`` first).

        Each name is looked up by itself: dumping every link of the host would
        cost each fork time in proportion to the sandboxes already running."""
        slots = self.cidr.num_addresses // 4
        if preferred is not None and 0 <= preferred < slots and not _link_exists(preferred):
            return preferred
        for index in range(slots):
            if not _link_exists(index):
                return index
        raise Unavailable(f"no free addresses left in --sandbox-cidr {self.cidr}")

    # ------------------------------------------------------------ leaks

    @staticmethod
    def namespaces() -> list[str]:
        """Every network namespace named like forkd's (of any daemon on this host)."""
        if not NETNS_DIR.is_dir():
            return []
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(NETNS_PREFIX))


def remove_unused(vm_id_prefixes: tuple[str, ...], live: set[str]) -> list[str]:
    """Remove the namespaces of VMs whose ids start with one of ``vm_id_prefixes``
    (one daemon's) and that are not in ``live``; returns their names."""
    removed = []
    for name in HostNetwork.namespaces():
        if name[len(NETNS_PREFIX) :].startswith(vm_id_prefixes) and name not in live:
            remove_namespace(name)
            removed.append(name)
    return removed


def destroy(net: SandboxNet) -> None:
    """Remove a VM's namespace, and with it its veth pair (both ends go together)."""
    remove_namespace(net.netns)


def remove_namespace(name: str) -> None:
    """Remove namespace ``name``; one already gone is skipped. Links are never deleted
    by name: a host-side name may since belong to another VM."""
    with contextlib.suppress(OSError):
        netns_ops.remove(name)


def netns_problems() -> list[str]:
    """Why this host cannot give each VM a namespace (empty when it can)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not running as root (needs CAP_NET_ADMIN)")
    if (problem := netns_ops.nftables_problem()) is not None:
        problems.append(problem)
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        problems.append("the Python package pyroute2 is not installed")
    if not Path("/dev/net/tun").exists():
        problems.append("/dev/net/tun is missing")
    return problems


async def attach(network: HostNetwork | None, vm_id: str, egress: Egress) -> SandboxNet | None:
    """A namespace for VM ``vm_id`` when ``network`` gives each VM one, else None; the
    egress proxy listening in it when the daemon has one."""
    if network is None or not network.enabled:
        return None
    host_nets = await asyncio.to_thread(network.host_nets)
    making = asyncio.ensure_future(asyncio.to_thread(network.create, vm_id, egress, host_nets))
    try:
        net = await asyncio.shield(making)
        if network.egress is not None:
            await network.egress.attach(net, vm_id, egress, host_nets)
    except BaseException:
        # The thread finishes what it started whatever happens here: undo it.
        with contextlib.suppress(Exception):
            await detach(await making)
        raise
    return net


async def listen(network: HostNetwork, net: SandboxNet, vm_id: str, egress: Egress) -> None:
    """The egress proxy listening in a namespace made before (an adopted VM's)."""
    if network.egress is not None:
        host_nets = await asyncio.to_thread(network.host_nets)
        await network.egress.attach(net, vm_id, egress, host_nets)


async def detach(net: SandboxNet | None) -> None:
    """Remove a VM's namespace (its QEMU must have exited), the proxy's sockets in it
    first."""
    if net is not None:
        for listener in _listeners:
            listener.release(net.netns)
        await asyncio.to_thread(destroy, net)
