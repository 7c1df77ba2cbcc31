"""Destinations as egress rules and secrets name them: host names, ``*.domain``
wildcards, IP addresses and networks, normalized the one way both sides compare.

A name is compared in its canonical form: lower case, the trailing dot gone,
each label IDNA-encoded (``Bücher.Example.`` is ``xn--bcher-kva.example``), so
a guest cannot pass a rule with a spelling of the name it does not list.
``*.example.com`` matches every name below ``example.com`` (not the name
itself); ``*`` matches every destination. Standard library only: the SDK and
the CLI check what a user typed with the daemon's own rules.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from forkd.errors import Invalid

MAX_NAME_CHARS = 253
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Characters IDNA 2003 maps away (ß to ss) and IDNA 2008 keeps (xn--...): one name would
# be two, so a rule and a guest could mean different hosts by it.
_DEVIATIONS = frozenset("\u00df\u03c2\u200c\u200d")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def canonical_name(name: str) -> str | None:
    """``name`` as rules compare it, or None when it is no valid DNS host name (an IP
    literal is not a name: see :func:`parse_destination`)."""
    if not name or len(name) > 4 * MAX_NAME_CHARS:
        return None
    text = name.strip().lower().removesuffix(".")
    if any(c in text for c in _DEVIATIONS):
        return None  # IDNA 2003 and 2008 read these apart: refused, never guessed
    try:
        ascii_name = text.encode("idna").decode("ascii") if not text.isascii() else text
    except UnicodeError:
        return None
    labels = ascii_name.split(".")
    if len(ascii_name) > MAX_NAME_CHARS or not all(_LABEL.fullmatch(part) for part in labels):
        return None
    if _is_ip(ascii_name) or labels[-1].isdigit():  # 1.2.3.4 or a numeric top label
        return None
    return ascii_name


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Destination:
    """One entry of an allow or deny list, or of a secret's hosts: exactly one of
    ``name`` (a host name, or the suffix of a wildcard), ``network``, or ``anything``."""

    text: str  # as it is shown back: canonical
    name: str | None = None
    wildcard: bool = False
    network: Network | None = None
    anything: bool = False

    def matches_name(self, host: str) -> bool:
        """Does this entry name the canonical host name ``host``?"""
        if self.anything:
            return True
        if self.name is None:
            return False
        return host.endswith("." + self.name) if self.wildcard else host == self.name

    def matches_address(self, address: Address) -> bool:
        return self.anything or (self.network is not None and address in self.network)


def parse_destination(text: str, *, names_only: bool = False) -> Destination:
    """An entry as typed: ``api.example.com``, ``*.example.com``, ``203.0.113.7``,
    ``10.0.0.0/8``, ``*``; :class:`Invalid` saying why not. ``names_only``: a
    secret's hosts, which are names or wildcards, never addresses or everything."""
    raw = text.strip() if isinstance(text, str) else ""
    if raw == "*":
        if names_only:
            raise Invalid("'*' would send the secret to every host: name its hosts")
        return Destination("*", anything=True)
    if raw.startswith("*."):
        suffix = canonical_name(raw[2:])
        if suffix is None:
            raise Invalid(f"{_shown(text)}: not a host name after '*.'")
        return Destination(f"*.{suffix}", name=suffix, wildcard=True)
    name = canonical_name(raw)
    if name is not None:
        return Destination(name, name=name)
    try:
        network = ipaddress.ip_network(raw, strict=False)
    except ValueError:
        raise Invalid(
            f"{_shown(text)}: not a host name, '*.domain', IP address or network"
        ) from None
    if names_only:
        raise Invalid(
            f"{_shown(text)}: a secret's hosts are names (an address has no name "
            "to check a certificate against)"
        )
    single = network.prefixlen == network.max_prefixlen  # an address: shown without /32
    return Destination(
        str(network.network_address) if single else network.compressed, network=network
    )


def _shown(text: object) -> str:
    value = repr(text)
    return value if len(value) <= 80 else value[:77] + "..."


def parse_destinations(
    entries: list[str], *, names_only: bool = False, limit: int = 256
) -> list[Destination]:
    """Each entry parsed, duplicates dropped (first kept), at most ``limit``."""
    if len(entries) > limit:
        raise Invalid(f"{len(entries)} entries: at most {limit}")
    seen: dict[str, Destination] = {}
    for entry in entries:
        parsed = parse_destination(entry, names_only=names_only)
        seen.setdefault(parsed.text, parsed)
    return list(seen.values())


def name_matches(host: str, entries: list[Destination]) -> bool:
    """Does any of ``entries`` name ``host`` (a name as a guest sent it)?"""
    name = canonical_name(host)
    return name is not None and any(entry.matches_name(name) for entry in entries)
