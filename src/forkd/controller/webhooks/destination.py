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
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from forkd.errors import Invalid

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


def _public(address: Address) -> bool:
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
    except OSError as exc:
        raise Invalid(f"the webhook's host {host!r} does not resolve: {exc}") from None
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    if not addresses:
        raise Invalid(f"the webhook's host {host!r} has no address")
    refused = [a for a in addresses if not _public(a)]
    if refused and not listed:
        raise Invalid(
            f"the webhook's host {host!r} is {refused[0]}, not a public address: the "
            f"daemon's operator may allow it with --webhook-allow {host}:{port}"
        )
    chosen = addresses[0]
    literal = f"[{chosen}]" if chosen.version == 6 else str(chosen)
    netloc = f"{literal}:{port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    is_name = host.strip("[]") != str(chosen)
    sni = host if parts.scheme == "https" and is_name else None
    return Destination(pinned, host_header, sni)
