"""The DNS name under which preview URLs get hosts of their own (``forkd serve
--preview-domain``); served by :mod:`forkd.controller.preview_hosts`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from forkd.errors import Invalid

_DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,200}}$){_DNS_LABEL}(\.{_DNS_LABEL})+$")
LABEL = re.compile(r"^[0-9]{1,5}-[a-z0-9-]{1,57}$")  # what :meth:`PreviewDomain.label` makes
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class PreviewDomain:
    """``DOMAIN[:PORT]`` (the scheme, and the port when none is given, are those the
    request for the URL came in by) or ``SCHEME://DOMAIN[:PORT]`` (exactly that)."""

    host: str
    scheme: str | None = None
    port: int | None = None

    @classmethod
    def of(cls, value: str) -> PreviewDomain:
        """:class:`Invalid` unless ``value`` is a DNS name of two labels or more, with
        an optional ``http``/``https`` scheme and port (and nothing else)."""
        text = value.strip().lower()
        parts = urlsplit(text if "://" in text else f"//{text}")
        port = _port(parts)
        if (
            parts.scheme not in ("", "http", "https")
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or parts.username is not None
            or port == -1
            or not _DNS_NAME.match(parts.hostname or "")
        ):
            raise Invalid(
                f"--preview-domain {value!r}: give a DNS name such as preview.example.com, "
                "optionally with http:// or https:// and a :port"
            )
        return cls(parts.hostname or "", parts.scheme or None, port)

    def __str__(self) -> str:
        """As ``--preview-domain`` takes it (so that ``of(str(d)) == d``)."""
        port = "" if self.port is None else f":{self.port}"
        return f"{self.scheme}://{self.host}{port}" if self.scheme else f"{self.host}{port}"

    @staticmethod
    def label(sandbox_id: str, port: int) -> str:
        return f"{port}-{sandbox_id}"

    def url(self, sandbox_id: str, port: int, token: str, via: str) -> str:
        """The preview URL of ``token``. ``via``: the URL the daemon was reached by (its
        scheme and port are the URL's, unless the domain gives them)."""
        base = urlsplit(via)
        scheme = self.scheme or base.scheme or "http"
        listen = self.port if self.scheme else self.port or _port(base)
        netloc = f"{self.label(sandbox_id, port)}.{self.host}"
        if listen not in (None, -1, DEFAULT_PORTS.get(scheme)):
            netloc += f":{listen}"
        return f"{scheme}://{netloc}/v1/preview/{token}/"

    def label_of(self, host_header: str) -> str | None:
        """The preview label a ``Host`` header names under this domain; ``""`` for any
        other name under it (no preview's: nothing is served there); None for a name
        not under it (the daemon's own)."""
        host = (urlsplit(f"//{host_header.strip().lower()}").hostname or "").rstrip(".")
        if not host.endswith(f".{self.host}"):
            return None
        label, _, rest = host.partition(".")
        return label if rest == self.host and LABEL.match(label) else ""


def _port(parts: SplitResult) -> int | None:
    """The URL's port, None when it has none, -1 when it is not a port."""
    try:
        return parts.port
    except ValueError:
        return -1
