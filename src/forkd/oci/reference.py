"""OCI references: ``registry[:port]/repository[:tag][@digest]``, checked before any request.

The grammar is the distribution project's (lower-case path components
separated by ``/``, ``.``, ``_``, ``__`` or dashes; tags of up to 128 word
characters, dots and dashes; ``sha256`` digests). A reference without a
registry host (``python:3.12``) names one only when the caller gives a default
registry (the daemon's ``--default-registry``); without one it is refused
before any name is looked up. Docker Hub's ``library/`` rule applies only
there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from forkd.errors import Invalid

DOCKER_HUB = "registry-1.docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"
)
MAX_LENGTH = 512


class NoRegistry(Invalid):
    """A reference without a registry host, and no default registry to put it under."""


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port], as the URL takes it
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What a manifest request names: the digest when there is one, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def host(self) -> str:
        """The registry's host name or address, without port or brackets."""
        return split_host_port(self.registry)[0]

    @property
    def port(self) -> int | None:
        """The registry's port, when the reference names one."""
        return split_host_port(self.registry)[1]

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, None, digest)

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse(text: str, default_registry: str | None = None) -> Reference:
    """The reference ``text`` names; :class:`Invalid` saying what is wrong with it.

    A reference without a registry host is under ``default_registry`` (host[:port]);
    with none, it is refused: nothing here looks a name up."""
    if not isinstance(text, str) or not text or len(text) > MAX_LENGTH:
        raise Invalid(f"registry reference must be 1 to {MAX_LENGTH} characters")
    if any(c.isspace() for c in text) or "://" in text:
        raise Invalid(f"invalid registry reference {text!r}: no scheme and no spaces")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not DIGEST.fullmatch(digest):
            raise Invalid(f"invalid digest in {text!r}: expected sha256:<64 hex digits>")
    if names_registry(rest):
        registry, path = rest.split("/", 1)
    elif default_registry is None:
        raise NoRegistry(
            f"registry reference {text!r} names no registry host: give a full reference "
            "(registry.example.com[:port]/repository:tag)"
        )
    else:
        registry, path = default_registry, rest
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise Invalid(f"invalid tag {tag!r} in {text!r}")
    if not _HOST.fullmatch(registry) or not _port_ok(registry):
        raise Invalid(f"invalid registry host {registry!r} in {text!r}")
    if not _REPOSITORY.fullmatch(path) or len(path) > 255:
        raise Invalid(
            f"invalid repository {path!r} in {text!r}: lower-case letters, digits and "
            "separators (. _ __ -) in components joined by /"
        )
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    return Reference(registry, path, tag, digest)


def names_registry(text: str) -> bool:
    """Whether the reference ``text`` starts with a registry host, as docker reads it: a
    first component with a dot, a port or brackets, or ``localhost``."""
    first, sep, _ = text.partition("/")
    return bool(sep) and (
        "." in first or ":" in first or first == "localhost" or first.startswith("[")
    )


def check_registry(text: str, what: str) -> str:
    """``text`` if it is a registry's ``host[:port]`` (``what`` names it in the error)."""
    if not isinstance(text, str) or not _HOST.fullmatch(text) or not _port_ok(text):
        raise Invalid(f"{what} {text!r} is not HOST[:PORT]")
    return text


def split_host_port(registry: str) -> tuple[str, int | None]:
    """``host[:port]`` (IPv6 in brackets) → the host, without brackets, and the port."""
    if registry.startswith("["):
        host, _, rest = registry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    host, _, port = registry.partition(":")
    return host, int(port) if port else None


def _port_ok(registry: str) -> bool:
    port = registry.rsplit("]", 1)[-1].rpartition(":")[2] if ":" in registry else ""
    return not port or 0 < int(port) < 65536
