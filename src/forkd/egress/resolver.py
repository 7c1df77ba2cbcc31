"""How the egress proxy finds where a name goes: the operator's pinned names first
(``--egress-hosts FILE``, hosts(5) format), then the host's resolver. The guest's
DNS answer is never asked.

A pinned name is the operator's decision: it may point at a private address
that no DNS answer would open (the networks the host is attached to stay shut
unless --egress-host-network opens them). The file is read again when it
changes, at most once a second.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from forkd.errors import Invalid
from forkd.host_names import canonical_name

log = logging.getLogger(__name__)
RESOLVE_TIMEOUT_SECS = 5.0
MAX_HOSTS_FILE_BYTES = 1 << 20
RECHECK_SECS = 1.0
IPv4 = ipaddress.IPv4Address


@dataclass(frozen=True)
class Resolved:
    addresses: tuple[IPv4, ...]
    pinned: bool  # from --egress-hosts: the operator's word


def parse_hosts(text: str, where: str) -> dict[str, tuple[IPv4, ...]]:
    """``ADDRESS NAME [NAME...]`` lines, ``#`` comments; IPv4 addresses only (a
    sandbox's namespace has no IPv6). A bad line is an :class:`Invalid` naming it."""
    pins: dict[str, list[IPv4]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            address = ipaddress.ip_address(words[0])
        except ValueError:
            raise Invalid(f"{where}:{number}: {words[0]!r} is not an IP address") from None
        if not isinstance(address, IPv4):
            raise Invalid(f"{where}:{number}: only IPv4 addresses (sandboxes have no IPv6)")
        if len(words) < 2:
            raise Invalid(f"{where}:{number}: an address with no name")
        for word in words[1:]:
            name = canonical_name(word)
            if name is None:
                raise Invalid(f"{where}:{number}: {word!r} is not a host name")
            pins.setdefault(name, []).append(address)
    return {name: tuple(dict.fromkeys(addrs)) for name, addrs in pins.items()}


class PinnedHosts:
    """``--egress-hosts``: read at start (a bad file stops the daemon), read again
    when it changes (a bad change is logged and the last good pins kept)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._pins: dict[str, tuple[IPv4, ...]] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        if path is not None:
            self._pins = self._read()

    def _read(self) -> dict[str, tuple[IPv4, ...]]:
        assert self.path is not None
        st = os.stat(self.path)
        self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if st.st_size > MAX_HOSTS_FILE_BYTES:
            raise Invalid(f"{self.path}: larger than {MAX_HOSTS_FILE_BYTES >> 20} MiB")
        return parse_hosts(self.path.read_text(encoding="utf-8"), str(self.path))

    def lookup(self, name: str) -> tuple[IPv4, ...] | None:
        self._refresh()
        return self._pins.get(name)

    def _refresh(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < RECHECK_SECS:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            if (st.st_mtime_ns, st.st_size, st.st_ino) != self._stamp:
                self._pins = self._read()
                log.info("--egress-hosts %s read again: %d names", self.path, len(self._pins))
        except (OSError, UnicodeDecodeError, Invalid) as exc:
            log.warning("--egress-hosts %s: %s; the names read before stay", self.path, exc)


class Resolver:
    def __init__(self, pins: PinnedHosts) -> None:
        self.pins = pins

    async def resolve(self, name: str) -> Resolved:
        """The IPv4 addresses of ``name`` (canonical); :class:`LookupError` saying why
        when it has none."""
        pinned = self.pins.lookup(name)
        if pinned is not None:
            return Resolved(pinned, True)
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM),
                RESOLVE_TIMEOUT_SECS,
            )
        except TimeoutError:
            raise LookupError(f"{name}: no DNS answer in {RESOLVE_TIMEOUT_SECS:.0f} s") from None
        except OSError as exc:
            raise LookupError(f"{name}: {exc.strerror or exc}") from None
        found = tuple(dict.fromkeys(IPv4(info[4][0]) for info in infos))
        if not found:
            raise LookupError(f"{name}: no IPv4 address")
        return Resolved(found, False)
