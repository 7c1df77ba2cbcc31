"""The operator's word on which registries the daemon reaches, checked before any name is
looked up and any connection made.

``--insecure-registry HOST[:PORT]`` (repeatable) lists the registries spoken to
over plain HTTP; no other is, loopback ones included. A registry on this host
(``localhost``, a loopback or unspecified address; a name that resolves there
is caught when connecting, :mod:`forkd.oci.connect`) is reached only when
listed, so a token holder cannot probe or poke the host's own services
through a push or a pull. Every other registry is HTTPS with its certificate
checked. ``--default-registry HOST[:PORT]`` is where a reference without a
registry host points; without it such a reference is refused.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from forkd.errors import Invalid
from forkd.oci import reference
from forkd.oci.reference import DOCKER_HUB, Reference

DOCKER_HUB_NAMES = frozenset({"docker.io", "index.docker.io", DOCKER_HUB})
_STANDARD_PORTS = (80, 443)  # a listed HOST without a port is the host on these
HostPort = tuple[str, int | None]


@dataclass(frozen=True)
class RegistryPolicy:
    """The registries spoken to over plain HTTP, and where a short reference points."""

    plain_http: frozenset[HostPort] = frozenset()
    default_registry: str | None = None  # host[:port]; Docker Hub's API host for docker.io

    @classmethod
    def of(cls, insecure: Iterable[str] = (), default: str | None = None) -> RegistryPolicy:
        """The policy of the daemon's options; :class:`Invalid` naming a malformed one."""
        listed = frozenset(
            _key(*reference.split_host_port(reference.check_registry(entry, "--insecure-registry")))
            for entry in insecure
        )
        if default is not None:
            default = reference.check_registry(default, "--default-registry").lower()
            default = DOCKER_HUB if default in DOCKER_HUB_NAMES else default
        return cls(listed, default)

    def parse(self, text: str) -> Reference:
        """The reference ``text`` names, a short one under the default registry; without
        one, a short reference is refused (no name is looked up)."""
        try:
            return reference.parse(text, self.default_registry)
        except reference.NoRegistry as exc:
            raise reference.NoRegistry(
                f"{exc}, or start the daemon with --default-registry HOST[:PORT]"
            ) from None

    def lists(self, host: str, port: int | None) -> bool:
        """Whether the operator listed ``host:port`` with ``--insecure-registry``."""
        return _key(host, port) in self.plain_http

    def scheme(self, ref: Reference, plain_asked: bool = False) -> str:
        """``http`` for a listed registry, else ``https``. :class:`Invalid` for a registry
        on this host that is not listed, or a request asking plain HTTP to one not listed:
        the operator's list is the only way to either."""
        if self.lists(ref.host, ref.port):
            return "http"
        if plain_asked:
            raise Invalid(
                f"plain HTTP to registry {ref.registry} is refused: this daemon speaks plain "
                "HTTP only to the registries its operator lists with --insecure-registry "
                "HOST[:PORT]"
            )
        if is_this_host(ref.host):
            raise Invalid(
                f"registry {ref.registry} is on the daemon's own host and not listed with its "
                "--insecure-registry HOST[:PORT]: refused, nothing was contacted"
            )
        return "https"


def is_this_host(host: str) -> bool:
    """``localhost`` (or a name under it), or an address that reaches this host's own
    services: loopback, unspecified, either as an IPv4-mapped IPv6 address."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _key(host: str, port: int | None) -> HostPort:
    return host.lower().strip("[]"), None if port in _STANDARD_PORTS else port
