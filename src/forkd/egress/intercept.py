"""Which hosts the egress proxy intercepts, and what it changes in their requests.

A host is intercepted when the sandbox's policy has a rule for it or a secret
may be sent to it; every other allowed HTTPS host passes through untouched.
In an intercepted request:

1. each rule's headers are set (replacing the guest's of the same name);
2. ``${secrets.NAME}`` anywhere in a header's value becomes the secret's value
   when the request's host is one of that secret's hosts, over TLS the proxy
   terminated and re-opened to the real host with verification. Anywhere else
   (another host, an unknown secret) the placeholder leaves as it came: the
   guest's request is not refused, and the value never goes where it does not
   belong.

The guest only ever holds placeholders.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from pathlib import Path
from typing import Protocol

from forkd.egress.ca import EgressCA, upstream_context
from forkd.egress.http import Headers
from forkd.limits import SECRET_PLACEHOLDER
from forkd.vmm.jail.egress import Egress

MINTS = 2  # certificates minted at once, each on a thread


class SecretSource(Protocol):
    """The daemon's secrets, as the proxy may ask of them (never listing values)."""

    def value_for(self, name: str, host: str) -> str | None: ...

    def any_for(self, host: str) -> bool: ...


class NoSecrets:
    def value_for(self, name: str, host: str) -> str | None:
        return None

    def any_for(self, host: str) -> bool:
        return False


class Interceptor:
    def __init__(self, ca: EgressCA, secrets: SecretSource, extra_ca: Path | None = None) -> None:
        self.ca = ca
        self.secrets = secrets
        self.extra_ca = extra_ca
        self._upstream: ssl.SSLContext | None = None
        self._minting = asyncio.Semaphore(MINTS)

    def wanted(self, name: str, policy: Egress) -> bool:
        return bool(policy.rules_for(name)) or self.secrets.any_for(name)

    async def server_context(self, name: str) -> ssl.SSLContext:
        """``name``'s certificate: from the cache, else minted on a thread, MINTS at a
        time (a guest asking for many names under a wildcard host waits its turn; the
        event loop does not)."""
        cached = self.ca.cached(name)
        if cached is not None:
            return cached
        async with self._minting:
            return await asyncio.to_thread(self.ca.server_context, name)

    def upstream_context(self) -> ssl.SSLContext:
        if self._upstream is None:
            self._upstream = upstream_context(self.extra_ca)
        return self._upstream

    def transform(self, name: str, policy: Egress, headers: Headers) -> tuple[Headers, list[str]]:
        """``headers`` of a request to ``name`` with the rules' headers set and the
        placeholders of ``name``'s secrets filled; and the secrets used, by name."""
        out = list(headers)
        for rule in policy.rules_for(name):
            for rule_header, rule_value in rule.headers:
                lowered = rule_header.lower().encode()
                out = [(n, v) for n, v in out if n.lower() != lowered]
                out.append((rule_header.encode(), rule_value.encode()))
        used: list[str] = []

        def fill(match: re.Match[str]) -> str:
            secret = match.group(1)
            value = self.secrets.value_for(secret, name)
            if value is None:
                return str(match.group(0))
            if secret not in used:
                used.append(secret)
            return value

        filled: Headers = []
        for field_name, raw in out:
            value = raw.decode("latin-1")
            if "${secrets." in value:
                value = SECRET_PLACEHOLDER.sub(fill, value)
            filled.append((field_name, value.encode("latin-1")))
        return filled, used
