"""What a sandbox may reach: its egress policy, and the addresses no policy opens.

A policy is the ``network`` object (E2B's shape): ``{"allow_out": [...],
"deny_out": [...], "rules": {HOST: [...]}}``, whose entries are host names,
``*.domain`` wildcards, IP addresses and CIDRs (:mod:`forkd.host_names`).
``deny_out`` wins over ``allow_out``; no ``allow_out`` means every public
destination. The older forms are the same policies: ``"none"`` is
``{"deny_out": ["*"]}``, ``"internet"`` is ``{}``, ``{"allow": [...]}`` is
``{"allow_out": [...]}``; a policy one of them can say is stored in it, so an
older daemon reads the snapshot.

The daemon's egress proxy (:mod:`forkd.egress`) decides each connection: by
the name a TLS ClientHello or an HTTP request gives, checked against the
names; by address, against the IPs and CIDRs, for anything else. Whatever the
policy, a sandbox never reaches the host itself, another sandbox, link-local
or metadata addresses, and reaches private ranges only when an entry names
them as an address or CIDR (or the operator pinned the name: --egress-hosts).
Without the proxy (``--egress-proxy off``) the namespace's nftables rules
decide by address alone, names resolved once when the sandbox starts.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any

from forkd.errors import Invalid
from forkd.host_names import Address, Destination, canonical_name, parse_destinations

MAX_ALLOW_ENTRIES = 64
MAX_RULE_HOSTS = 64
MAX_TRANSFORM_HEADERS = 16
MAX_HEADER_NAME_CHARS = 128
MAX_HEADER_VALUE_CHARS = 8192
# Headers that say where a request goes or how it is framed: never set by a rule.
FRAMING_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
    }
)

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
_BLOCKED = tuple(ipaddress.IPv4Network(r) for r in BLOCKED_RANGES)


@dataclass(frozen=True)
class HeaderRule:
    """A transform of requests to a host: headers set (placeholders substituted)."""

    headers: tuple[tuple[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"transform": {"headers": dict(self.headers)}}


@dataclass(frozen=True)
class Egress:
    mode: str  # "none" | "internet" | "allow": what allow_out says
    allow: tuple[str, ...] = ()  # allow_out, as given (canonical once parsed)
    deny: tuple[str, ...] = ()  # deny_out
    rules: tuple[tuple[str, tuple[HeaderRule, ...]], ...] = ()  # host -> its transforms
    _allow: tuple[Destination, ...] = field(default=(), compare=False, repr=False)
    _deny: tuple[Destination, ...] = field(default=(), compare=False, repr=False)
    _rule_hosts: tuple[Destination, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_allow", tuple(parse_destinations(list(self.allow), limit=MAX_ALLOW_ENTRIES))
        )
        object.__setattr__(
            self, "_deny", tuple(parse_destinations(list(self.deny), limit=MAX_ALLOW_ENTRIES))
        )
        object.__setattr__(
            self, "_rule_hosts", tuple(parse_destinations([h])[0] for h, _ in self.rules)
        )

    @classmethod
    def parse(cls, value: Any) -> Egress:
        """``"none"``, ``"internet"``, ``{"allow": [...]}`` or the network object;
        :class:`Invalid` otherwise."""
        if value in ("none", "internet"):
            return cls(str(value))
        if isinstance(value, dict) and set(value) == {"allow"}:
            return cls("allow", _entries(value["allow"], "egress.allow"))
        if isinstance(value, dict) and value and set(value) <= {"allow_out", "deny_out", "rules"}:
            return cls.of_network(value)
        raise Invalid(
            "egress must be 'none', 'internet', {'allow': [...]} or a network object "
            f"{{'allow_out', 'deny_out', 'rules'}}, not {_shown(value)}"
        )

    @classmethod
    def of_network(cls, value: dict[str, Any]) -> Egress:
        """The ``network`` object of the API (each key optional)."""
        allow = _entries(value.get("allow_out") or [], "allow_out")
        deny = _entries(value.get("deny_out") or [], "deny_out")
        rules = _rules(value.get("rules") or {})
        return cls("allow" if allow else "internet", allow, deny, rules)

    @classmethod
    def from_internet(cls, internet: bool) -> Egress:
        return cls("internet" if internet else "none")

    def to_json(self) -> str | dict[str, Any]:
        if not self.deny and not self.rules:
            return {"allow": list(self.allow)} if self.mode == "allow" else self.mode
        return self.network()

    def network(self) -> dict[str, Any]:
        """The policy as the API's network object."""
        deny = ["*"] if self.mode == "none" else [d.text for d in self._deny]
        return {
            "allow_out": [d.text for d in self._allow],
            "deny_out": deny,
            "rules": {host: [r.to_json() for r in rs] for host, rs in self.rules},
        }

    # ------------------------------------------------------------ decisions

    @property
    def shut(self) -> bool:
        """Nothing at all leaves (``"none"``, or ``*`` denied)."""
        return self.mode == "none" or any(d.anything for d in self._deny)

    def allows_name(self, name: str) -> bool:
        """May a connection named ``name`` (canonical) leave? Not yet where it goes."""
        if self.shut or any(d.matches_name(name) for d in self._deny):
            return False
        return self.mode == "internet" or any(d.matches_name(name) for d in self._allow)

    def allows_address(self, address: Address, *, named: bool) -> bool:
        """May a connection to ``address`` leave: one the guest sent to an address
        (``named`` False: only IP and CIDR entries allow it), or the address a name the
        policy allows resolved to (``named``: only denials by address stop it)?"""
        if self.shut or any(d.matches_address(address) for d in self._deny if d.network):
            return False
        if named or self.mode == "internet":
            return True
        return any(d.matches_address(address) for d in self._allow if d.network is not None)

    def resolves(self, name: str) -> bool:
        """Should the guest's DNS answer for ``name`` (canonical)? Not for a name it may
        never reach: denied, or not in an allow list of names only (an allow list with
        addresses may need names of them, for TCP judged by address)."""
        if self.shut or any(d.matches_name(name) for d in self._deny):
            return False
        if self.mode == "internet" or any(d.matches_name(name) for d in self._allow):
            return True
        return any(d.network is not None for d in self._allow)

    def opens_private(self, address: Address) -> bool:
        """Does an address or CIDR entry name this address of a private range?"""
        return any(d.network is not None and address in d.network for d in self._allow)

    def rules_for(self, name: str) -> tuple[HeaderRule, ...]:
        """The transforms of requests to ``name`` (canonical): every matching rule's."""
        found: list[HeaderRule] = []
        for (_host, rules), entry in zip(self.rules, self._rule_hosts, strict=True):
            if entry.matches_name(name):
                found.extend(rules)
        return tuple(found)

    def denied_networks(self) -> list[ipaddress.IPv4Network]:
        """The IPv4 addresses and CIDRs of deny_out (without the proxy, all it can deny)."""
        return [d.network for d in self._deny if isinstance(d.network, ipaddress.IPv4Network)]

    def resolve(self) -> list[ipaddress.IPv4Network]:
        """Without the proxy: the allow list as IPv4 networks, hostnames looked up now."""
        nets: list[ipaddress.IPv4Network] = []
        for entry in self._allow:
            if entry.network is not None:
                if isinstance(entry.network, ipaddress.IPv4Network):
                    nets.append(entry.network)
            elif entry.name is not None and not entry.wildcard:
                # Only a literal CIDR may open a private range: a name's DNS record
                # is not the caller's word (it may point at 169.254.169.254).
                nets += [n for n in _lookup(entry.name) if not _blocked(n)]
        return nets


def blocked(address: Address) -> bool:
    """In a private (or otherwise never public) range of :data:`BLOCKED_RANGES`?"""
    return any(address in net for net in _BLOCKED)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _entries(entries: Any, what: str) -> tuple[str, ...]:
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise Invalid(f"{what} must be a list of host names, '*.domain', addresses or CIDRs")
    if len(entries) > MAX_ALLOW_ENTRIES:
        raise Invalid(f"{what} takes at most {MAX_ALLOW_ENTRIES} entries")
    try:
        return tuple(d.text for d in parse_destinations(entries, limit=MAX_ALLOW_ENTRIES))
    except Invalid as exc:
        raise Invalid(f"{what}: {exc}") from None


def _rules(value: Any) -> tuple[tuple[str, tuple[HeaderRule, ...]], ...]:
    """``{HOST: [{"transform": {"headers": {NAME: VALUE}}}]}``, checked."""
    if not isinstance(value, dict) or len(value) > MAX_RULE_HOSTS:
        raise Invalid(f"rules must be an object of at most {MAX_RULE_HOSTS} hosts")
    parsed = []
    for host, rules in value.items():
        entry = _rule_host(host)
        if not isinstance(rules, list) or not rules:
            raise Invalid(f"rules[{host!r}] must be a non-empty list of transforms")
        parsed.append((entry, tuple(_rule(host, r) for r in rules)))
    return tuple(parsed)


def _rule_host(host: Any) -> str:
    if not isinstance(host, str):
        raise Invalid("a rule's host must be a string")
    try:
        [entry] = parse_destinations([host], names_only=True)
    except Invalid as exc:
        raise Invalid(f"rules: {exc}") from None
    return entry.text


def _rule(host: str, rule: Any) -> HeaderRule:
    headers = rule.get("transform", {}).get("headers") if isinstance(rule, dict) else None
    if (
        not isinstance(rule, dict)
        or set(rule) != {"transform"}
        or not isinstance(rule["transform"], dict)
        or set(rule["transform"]) != {"headers"}
        or not isinstance(headers, dict)
        or not headers
        or len(headers) > MAX_TRANSFORM_HEADERS
    ):
        raise Invalid(
            f"rules[{host!r}]: each rule is {{'transform': {{'headers': {{NAME: VALUE}}}}}} "
            f"with 1-{MAX_TRANSFORM_HEADERS} headers"
        )
    for name, text in headers.items():
        if not (
            isinstance(name, str)
            and 0 < len(name) <= MAX_HEADER_NAME_CHARS
            and all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in name)
        ):
            raise Invalid(f"rules[{host!r}]: {_shown(name)} is no HTTP header name")
        if not (
            isinstance(text, str)
            and len(text) <= MAX_HEADER_VALUE_CHARS
            and all(" " <= c <= "~" or c == "\t" for c in text)
            and text == text.strip(" \t")
        ):
            raise Invalid(
                f"rules[{host!r}]: the value of {name} must be visible ASCII, with no "
                "space or tab at either end"
            )
        if name.lower() in FRAMING_HEADERS:
            raise Invalid(f"rules[{host!r}]: {name} is the proxy's to send, not a rule's")
    return HeaderRule(tuple(headers.items()))


def requested(egress: Any, internet: bool | None, network: Any = None) -> Egress | None:
    """The policy a request asks for (``network``, ``egress``, or the older ``internet``);
    None: the default."""
    given = [
        n
        for n, v in (("network", network), ("egress", egress), ("internet", internet))
        if v is not None
    ]
    if len(given) > 1:
        raise Invalid(f"give one of 'network', 'egress' or 'internet', not {' and '.join(given)}")
    if network is not None:
        data = network.model_dump(exclude_none=True) if hasattr(network, "model_dump") else network
        return Egress.of_network(data) if data else Egress("internet")
    if egress is not None:
        return Egress.parse(egress.model_dump() if hasattr(egress, "model_dump") else egress)
    return None if internet is None else Egress.from_internet(internet)


def of_machine(egress_json: Any, internet: bool) -> Egress:
    """The policy a snapshot records (``machine.egress``), or its older ``internet`` flag."""
    return Egress.parse(egress_json) if egress_json is not None else Egress.from_internet(internet)


def _blocked(net: ipaddress.IPv4Network) -> bool:
    return any(net.overlaps(b) for b in _BLOCKED)


def _lookup(hostname: str) -> list[ipaddress.IPv4Network]:
    try:
        infos = socket.getaddrinfo(hostname, None, family=socket.AF_INET)
    except OSError as exc:
        raise Invalid(f"egress.allow: cannot resolve {hostname!r}: {exc}") from exc
    return sorted({ipaddress.IPv4Network(f"{info[4][0]}/32") for info in infos})


__all__ = ["BLOCKED_RANGES", "Egress", "HeaderRule", "blocked", "canonical_name"]
