"""One sandbox as the egress proxy holds it while attached to its namespace.

Its listener and DNS socket, made inside the namespace; the upstream sockets made
there a batch at a time; its policy, the fence around it and its meter; and where
each of its open connections goes, so that a new policy closes those it denies
(:func:`still_allowed`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field

from forkd.egress import decide
from forkd.egress.decide import Fence, Refused
from forkd.egress.meter import Meter
from forkd.vmm.jail import netns_ops
from forkd.vmm.jail.addresses import DNS_PORT, GATEWAY_IP, PROXY_PORT
from forkd.vmm.jail.egress import Egress

SOCKET_BATCH = 8  # upstream sockets made inside a namespace at a time


class UpstreamSockets:
    """Upstream sockets made inside one namespace, a batch at a time (each batch costs
    a thread that enters it)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._stock: list[socket.socket] = []
        self._lock = asyncio.Lock()

    async def take(self) -> socket.socket:
        async with self._lock:
            if not self._stock:
                self._stock = await asyncio.to_thread(
                    netns_ops.run_inside,
                    self.netns,
                    lambda: [
                        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                        for _ in range(SOCKET_BATCH)
                    ],
                )
            return self._stock.pop()

    def close(self) -> None:
        for sock in self._stock:
            sock.close()
        self._stock.clear()


@dataclass
class Attachment:
    """One sandbox attached: what its connections are judged by and go through, and
    what the proxy holds open in its namespace."""

    vm_id: str
    netns: str
    policy: Egress
    fence: Fence
    sockets: UpstreamSockets
    meter: Meter
    listener: socket.socket | None = None
    accepting: asyncio.Task[None] | None = None
    dns: asyncio.DatagramTransport | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Where each open connection goes (the name it was allowed by, else its address):
    # a new policy closes those it denies.
    going: dict[asyncio.Task[None], tuple[str | None, ipaddress.IPv4Address | None]] = field(
        default_factory=dict
    )


def going(sb: Attachment, name: str | None, address: ipaddress.IPv4Address | None) -> None:
    """Note where the current connection goes (by name when a name allowed it)."""
    task = asyncio.current_task()
    if task is not None:
        sb.going[task] = (name, address)


def still_allowed(
    policy: Egress, fence: Fence, name: str | None, address: ipaddress.IPv4Address | None
) -> bool:
    """Does ``policy`` still let an open connection be: one allowed by ``name`` (its
    address then only against the policy's address denials), or by its address?"""
    if name is not None and not policy.allows_name(name):
        return False
    if address is None:
        return not policy.shut
    try:
        decide.check_address(address, policy, fence, named=name is not None)
    except Refused:
        return False
    return True


def listener_and_dns() -> tuple[socket.socket, socket.socket]:
    """Made on one thread inside the namespace: the proxy's listener and DNS socket."""
    listener = _listening_socket()
    try:
        dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            dns.bind((GATEWAY_IP, DNS_PORT))
            dns.setblocking(False)
        except BaseException:
            dns.close()
            raise
    except BaseException:
        listener.close()
        raise
    return listener, dns


def _listening_socket() -> socket.socket:
    """Made on a thread inside the namespace: the proxy's listener there."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((GATEWAY_IP, PROXY_PORT))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
