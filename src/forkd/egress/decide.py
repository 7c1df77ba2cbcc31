"""Whether a sandbox may reach a name or an address, and which address a name's
connection goes to.

Three layers, in order, each able only to refuse:

1. the **fence**: addresses no policy opens (loopback, link-local and metadata,
   multicast, the guest's own network, the sandboxes' range, and the networks
   and addresses of the host: those the operator opened with
   --egress-host-network are left out of it by the daemon);
2. the **policy** (:class:`~forkd.vmm.jail.egress.Egress`): a name against its
   names, an address against its addresses and CIDRs;
3. **private ranges** (:data:`~forkd.vmm.jail.egress.BLOCKED_RANGES`): open only
   to an address or CIDR entry that names them, or to a name the operator
   pinned (--egress-hosts).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from forkd.egress.resolver import Resolver
from forkd.host_names import canonical_name
from forkd.vmm.jail.addresses import GUEST_NETWORK
from forkd.vmm.jail.egress import Egress, blocked
from forkd.vmm.jail.rulesets import ALWAYS_BLOCKED

IPv4 = ipaddress.IPv4Address
# What the namespace's own rules always drop, and the guest's own network.
ALWAYS_FENCED = (*ALWAYS_BLOCKED, GUEST_NETWORK)


class Refused(Exception):
    """The connection may not leave; the message says why (for the guest and the log)."""


@dataclass(frozen=True)
class Fence:
    networks: tuple[ipaddress.IPv4Network, ...]

    @classmethod
    def of(cls, sandbox_cidr: str, host_nets: list[ipaddress.IPv4Network]) -> Fence:
        nets = [ipaddress.IPv4Network(n) for n in ALWAYS_FENCED]
        return cls((*nets, ipaddress.IPv4Network(sandbox_cidr), *host_nets))

    def holds(self, address: IPv4) -> bool:
        return any(address in net for net in self.networks)


def check_address(
    address: IPv4, policy: Egress, fence: Fence, *, named: bool, pinned: bool = False
) -> None:
    """:class:`Refused` unless a connection to ``address`` may leave: one the guest sent
    to an address (``named`` False), or where an allowed name goes."""
    if fence.holds(address):
        raise Refused(f"{address} is the host's, a sandbox's or never reachable")
    if not policy.allows_address(address, named=named):
        raise Refused(f"{address} is not allowed by the sandbox's network policy")
    if blocked(address) and not pinned and not policy.opens_private(address):
        raise Refused(
            f"{address} is a private address: only an allow_out address or CIDR entry "
            "(or a name the operator pinned with --egress-hosts) opens it"
        )


def checked_name(given: str) -> str:
    """The canonical form of a name a guest sent; :class:`Refused` when it is none (an
    IP literal in SNI or Host is judged as an address by the caller)."""
    name = canonical_name(given)
    if name is None:
        raise Refused(f"{given[:80]!r} is not a host name")
    return name


async def destination(name: str, policy: Egress, fence: Fence, resolver: Resolver) -> IPv4:
    """Where a connection for ``name`` (canonical) goes: the first of its addresses
    that passes; :class:`Refused` when the name or every address is refused."""
    if not policy.allows_name(name):
        raise Refused(f"{name} is not allowed by the sandbox's network policy")
    try:
        found = await resolver.resolve(name)
    except LookupError as exc:
        raise Refused(f"cannot resolve {exc}") from None
    reasons = []
    for address in found.addresses:
        try:
            check_address(address, policy, fence, named=True, pinned=found.pinned)
        except Refused as exc:
            reasons.append(str(exc))
            continue
        return address
    raise Refused(f"{name} resolves only to refused addresses: {reasons[0]}")


def ip_literal(text: str) -> IPv4 | None:
    """``text`` as an IPv4 address, if it is one (``[::1]`` and IPv6: refused later)."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    return address if isinstance(address, IPv4) else None
