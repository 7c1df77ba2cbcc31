"""Where a delivery may go: an endpoint's name resolved once per attempt, every address
it has checked, and the request sent to the checked address (the name kept for the Host
header and TLS), so a name that resolves elsewhere between the check and the connection
(DNS rebinding) cannot turn a delivery toward the host or its network.

Loopback, link-local, private and other non-public addresses are refused unless the
operator listed the endpoint with ``--webhook-allow HOST[:PORT]``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from forkd.errors import Invalid

log = logging.getLogger(__name__)
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Destination:
    url: str  # with the checked address in place of the name
    host: str  # the Host header
    sni: str | None  # the name TLS verifies (https with a name)


def allowed(allow: tuple[str, ...], host: str, port: int) -> bool:
    """Whether ``host:port`` (or ``host``, any port) is on the operator's list."""
    bare = host.strip("[]").lower()
    shown = f"[{bare}]" if ":" in bare else bare
    return any(entry.lower() in (bare, shown, f"{shown}:{port}") for entry in allow)


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 through a NAT64 gateway
SITE_LOCAL = ipaddress.ip_network("fec0::/10")  # deprecated, still private in practice


def _embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64, compatible)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64 or int(address) >> 32 == 0:  # ::a.b.c.d, the old compatible form
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _public(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        if address in SITE_LOCAL or address.scope_id:
            return False
        inner = _embedded(address)
        if inner is not None and not _public(inner):
            return False
    return address.is_global and not address.is_multicast


async def resolve(url: str, allow: tuple[str, ...]) -> Destination:
    """The checked destination of ``url``; :class:`Invalid` for one that may not be
    reached (no address, or one that is not public and not allowed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    listed = allowed(allow, host, port)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    except (OSError, ValueError) as exc:  # UnicodeError (a bad label) is a ValueError
        log.info("webhook host %r: %s", host, exc)
        raise Invalid(f"the webhook's host {host!r} does not resolve") from None
    if not addresses:
        raise Invalid(f"the webhook's host {host!r} does not resolve")
    refused = [a for a in addresses if not _public(a)]
    if refused and not listed:  # which address is not said: no lookup of inside names
        raise Invalid(
            f"the webhook's host {host!r} is not a public address: the daemon's operator "
            f"may allow it with --webhook-allow {host}:{port}"
        )
    chosen = addresses[0]
    literal = f"[{str(chosen).partition('%')[0]}]" if chosen.version == 6 else str(chosen)
    netloc = f"{literal}:{port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    is_name = host.strip("[]") != str(chosen)
    sni = host if parts.scheme == "https" and is_name else None
    return Destination(pinned, host_header, sni)
