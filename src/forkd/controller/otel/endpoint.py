"""``--otlp-endpoint``'s URL, checked without loading OpenTelemetry."""

from __future__ import annotations

from urllib.parse import urlsplit

from forkd.errors import Invalid


def endpoint_base(url: str) -> str:
    """``--otlp-endpoint``'s URL, checked: http or https, a host, no query; without its
    trailing ``/`` (the signals' paths are added to it)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise Invalid(f"--otlp-endpoint {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid(f"--otlp-endpoint {url!r}: give http(s)://HOST[:PORT][/PATH]")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise Invalid(
            f"--otlp-endpoint {url!r}: no query, fragment or credentials "
            "(a collector's credentials go in OTEL_EXPORTER_OTLP_HEADERS)"
        )
    return url.rstrip("/")
