"""The egress proxy: one asyncio server in the daemon serving a listener inside each
sandbox's namespace.

The namespace's nftables rules redirect every TCP connection the guest opens to
``10.0.2.2:15001`` (:mod:`forkd.vmm.jail.network`); the proxy reads where it
was going (``SO_ORIGINAL_DST``) and its first bytes, decides (:mod:`.decide`),
and opens the upstream connection from a socket made inside the same
namespace, so what fences sandboxes in on the host applies to it unchanged.

- TLS: the ClientHello's server name decides, and the bytes pass through
  untouched (never decrypted).
- HTTP: each request's Host decides (:mod:`.http`).
- Anything else (or a guest that says nothing for a second, as clients of
  servers that speak first do): the original address, by the policy's
  addresses and CIDRs only.

Each connection is served by a :class:`~.connection.Connection`, and each sandbox
attached is an :class:`~.attachment.Attachment`.

Per sandbox at most :data:`MAX_CONNECTIONS` connections are open at once, holding
at most its :class:`~.meter.Meter`'s share of bytes in the daemon (and moving no
faster than its rate, when the operator set one); a first request has
:data:`~.http.HEAD_SECS` to arrive; a connection idle both ways for
:data:`~.splice.IDLE_SECS` is closed.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging

from forkd import limits
from forkd.egress.attachment import Attachment, UpstreamSockets, listener_and_dns, still_allowed
from forkd.egress.connection import Connection, Interception
from forkd.egress.decide import Fence
from forkd.egress.dns import SandboxDNS
from forkd.egress.meter import HELD_BYTES, Meter
from forkd.egress.records import EgressLog, EgressRecord
from forkd.egress.resolver import Resolver
from forkd.vmm.jail import netns_ops
from forkd.vmm.jail.egress import Egress
from forkd.vmm.jail.network import SandboxNet

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512  # open at once per sandbox; more are closed as they come
# ... and for all sandboxes at once, at most a quarter of the descriptors this process
# may open (each connection holds two): a flood of guests cannot starve the daemon.
MAX_ALL_CONNECTIONS = 65536


class EgressProxy:
    """Attached to each namespace as it is made (:class:`~forkd.vmm.jail.network.
    EgressListener`), released as it goes."""

    def __init__(
        self,
        resolver: Resolver,
        sandbox_cidr: str,
        log_: EgressLog | None = None,
        interception: Interception | None = None,
        dns_upstream: str | None = None,
        held_bytes: int = HELD_BYTES,
        rate: int | None = None,
    ) -> None:
        self.resolver = resolver
        self.dns_upstream = dns_upstream  # the host's resolver, for the guests' DNS
        self.sandbox_cidr = sandbox_cidr
        self.log = log_ or EgressLog()
        self.interception = interception
        self._sandboxes: dict[str, Attachment] = {}  # by namespace name
        self.open = 0  # connections served now, every sandbox's
        # Read once, not at every accept (forkd serve raised the limit before).
        self.max_open = max(64, limits.descriptor_share(MAX_ALL_CONNECTIONS))
        self.held_bytes = held_bytes  # each sandbox's share (.meter)
        self.rate = rate  # bytes a second each way, each sandbox; None: unbounded

    # ------------------------------------------------------------ namespaces

    async def attach(
        self, net: SandboxNet, vm_id: str, policy: Egress, host_nets: list[ipaddress.IPv4Network]
    ) -> None:
        """Listen inside ``net``'s namespace for its guest's connections."""
        self.release(net.netns)
        listener, dns_sock = await asyncio.to_thread(
            netns_ops.run_inside, net.netns, listener_and_dns
        )
        sb = Attachment(
            vm_id,
            net.netns,
            policy,
            Fence.of(self.sandbox_cidr, host_nets),
            UpstreamSockets(net.netns),
            Meter(self.held_bytes, self.rate),
            listener,
        )
        self._sandboxes[net.netns] = sb
        try:
            loop = asyncio.get_running_loop()
            sb.dns, _ = await loop.create_datagram_endpoint(
                lambda: SandboxDNS(lambda: sb.policy, self.resolver.pins, self.dns_upstream),
                sock=dns_sock,
            )
        except BaseException:
            dns_sock.close()
            self.release(net.netns)
            raise
        sb.accepting = asyncio.ensure_future(self._accept(sb))

    def release(self, netns: str) -> None:
        """Stop listening in ``netns`` and cut its connections (its namespace goes: no
        socket of ours may keep it alive)."""
        sb = self._sandboxes.pop(netns, None)
        if sb is None:
            return
        if sb.accepting is not None:
            sb.accepting.cancel()
        if sb.listener is not None:
            sb.listener.close()
        if sb.dns is not None:
            sb.dns.close()
        for task in sb.tasks:
            task.cancel()
        sb.sockets.close()

    def set_policy(self, vm_id: str, policy: Egress) -> int:
        """New connections of ``vm_id``'s guest are judged by ``policy`` from now on, and
        its open connections that ``policy`` denies are closed; how many were."""
        closed = 0
        for sb in self._sandboxes.values():
            if sb.vm_id != vm_id:
                continue
            sb.policy = policy
            for task, (name, address) in list(sb.going.items()):
                if not still_allowed(policy, sb.fence, name, address):
                    task.cancel()
                    closed += 1
        return closed

    def meter_of(self, vm_id: str) -> Meter | None:
        """``vm_id``'s share of the proxy, while it is attached."""
        return next((sb.meter for sb in self._sandboxes.values() if sb.vm_id == vm_id), None)

    def policy_of(self, vm_id: str) -> Egress | None:
        return next((sb.policy for sb in self._sandboxes.values() if sb.vm_id == vm_id), None)

    async def close(self) -> None:
        for netns in list(self._sandboxes):
            self.release(netns)

    # ------------------------------------------------------------ connections

    async def _accept(self, sb: Attachment) -> None:
        assert sb.listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sb.listener)
            except OSError as exc:  # out of descriptors, or the listener closed
                log.warning("egress proxy of %s cannot accept: %s", sb.vm_id, exc)
                await asyncio.sleep(0.1)
                continue
            if len(sb.tasks) >= MAX_CONNECTIONS or self.open >= self.max_open:
                conn.close()
                what = "this sandbox's" if len(sb.tasks) >= MAX_CONNECTIONS else "all sandboxes'"
                self._refused(sb, "tcp", None, 0, f"too many connections open ({what})")
                continue
            self.open += 1
            task = asyncio.ensure_future(Connection(self, sb, conn).serve())
            sb.tasks.add(task)
            task.add_done_callback(sb.tasks.discard)
            task.add_done_callback(functools.partial(_gone, self, sb))

    def _refused(self, sb: Attachment, kind: str, host: str | None, port: int, why: str) -> None:
        self.log.add(EgressRecord(sb.vm_id, "refused", kind, host, port, reason=why))


def _gone(proxy: EgressProxy, sb: Attachment, task: asyncio.Task[None]) -> None:
    sb.going.pop(task, None)
    proxy.open -= 1
