"""What a sandbox may reach: its egress policy, and the addresses no policy opens.

A policy is ``"none"``, ``"internet"`` or ``{"allow": [CIDR or hostname, ...]}``.
Hostnames are resolved once, when the sandbox starts. Whatever the policy,
a sandbox never reaches the host itself, another sandbox, link-local or
metadata addresses, and reaches private ranges only when an ``allow`` entry
names them explicitly.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

from forkd.errors import Invalid

MAX_ALLOW_ENTRIES = 64

# Never reachable unless an allow entry names (a part of) them; the host and
# the other sandboxes are dropped by the host's own rules in any case.
BLOCKED_RANGES = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",
    "100.64.0.0/10",  # carrier-grade NAT
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local, cloud metadata (169.254.169.254)
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, broadcast
)


@dataclass(frozen=True)
class Egress:
    mode: str  # "none" | "internet" | "allow"
    allow: tuple[str, ...] = ()  # as given: CIDRs, addresses or hostnames

    @classmethod
    def parse(cls, value: Any) -> Egress:
        """``"none"``, ``"internet"`` or ``{"allow": [...]}``; :class:`Invalid` otherwise."""
        if value in ("none", "internet"):
            return cls(str(value))
        if isinstance(value, dict) and set(value) == {"allow"}:
            entries = value["allow"]
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                raise Invalid("egress.allow must be a list of CIDRs or hostnames")
            if len(entries) > MAX_ALLOW_ENTRIES:
                raise Invalid(f"egress.allow takes at most {MAX_ALLOW_ENTRIES} entries")
            for entry in entries:
                _check_entry(entry)
            return cls("allow", tuple(entries))
        raise Invalid(
            f"egress must be 'none', 'internet' or {{'allow': [CIDR or hostname, ...]}}, "
            f"not {value!r}"
        )

    @classmethod
    def from_internet(cls, internet: bool) -> Egress:
        return cls("internet" if internet else "none")

    def to_json(self) -> str | dict[str, list[str]]:
        return {"allow": list(self.allow)} if self.mode == "allow" else self.mode

    def resolve(self) -> list[ipaddress.IPv4Network]:
        """The allow list as IPv4 networks, hostnames looked up now."""
        nets: list[ipaddress.IPv4Network] = []
        for entry in self.allow:
            try:
                net = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                # Only a literal CIDR opens a private range: a name's DNS record
                # is not the caller's word (it may point at 169.254.169.254).
                nets += [n for n in _lookup(entry) if not _blocked(n)]
                continue
            if isinstance(net, ipaddress.IPv4Network):
                nets.append(net)
        return nets


def requested(egress: Any, internet: bool | None) -> Egress | None:
    """The policy a request asks for (``egress``, or the older ``internet``); None: default."""
    if egress is not None and internet is not None:
        raise Invalid("give 'egress' or 'internet', not both")
    if egress is not None:
        return Egress.parse(egress.model_dump() if hasattr(egress, "model_dump") else egress)
    return None if internet is None else Egress.from_internet(internet)


def of_machine(egress_json: Any, internet: bool) -> Egress:
    """The policy a snapshot records (``machine.egress``), or its older ``internet`` flag."""
    return Egress.parse(egress_json) if egress_json is not None else Egress.from_internet(internet)


def _blocked(net: ipaddress.IPv4Network) -> bool:
    return any(net.overlaps(ipaddress.IPv4Network(r)) for r in BLOCKED_RANGES)


def _check_entry(entry: str) -> None:
    try:
        ipaddress.ip_network(entry, strict=False)
        return
    except ValueError:
        pass
    labels = entry.rstrip(".").split(".")
    ok = 0 < len(entry) <= 253 and all(
        0 < len(lb) <= 63 and lb.replace("-", "").isalnum() and not lb.startswith("-")
        for lb in labels
    )
    if not ok:
        raise Invalid(f"egress.allow entry {entry!r} is neither a CIDR nor a hostname")


def _lookup(hostname: str) -> list[ipaddress.IPv4Network]:
    try:
        infos = socket.getaddrinfo(hostname, None, family=socket.AF_INET)
    except OSError as exc:
        raise Invalid(f"egress.allow: cannot resolve {hostname!r}: {exc}") from exc
    return sorted({ipaddress.IPv4Network(f"{info[4][0]}/32") for info in infos})
