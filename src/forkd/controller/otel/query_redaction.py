"""Query strings leave the daemon in spans without their values.

OpenTelemetry's HTTP server instrumentation records the request's URL with its query
(``url.query``, ``http.target``, ``http.url``, ``url.full``) and redacts only a few
cloud storage signature names. forkd's queries carry secrets of their own (the signed
upload links of E2B builds, ``?signature=``; preview tokens), so the whole query is
replaced as the request's span is made. Not only its values: the instrumentation records
the query percent-decoded, so an ``&`` or ``=`` inside a value would make part of it
look like a name. The route template (the span's name, ``http.route``) stays, which is
what finding a slow request needs.
"""

from __future__ import annotations

from typing import Any

REDACTED = "REDACTED"
QUERY_KEYS = ("url.query",)  # the query alone
URL_KEYS = ("http.url", "url.full", "http.target")  # a URL or a path with its query


def redact_url(url: str) -> str:
    """A URL, or a path with a query, with its query replaced by ``REDACTED``."""
    head, mark, _query = url.partition("?")
    return f"{head}?{REDACTED}" if mark else url


def redact_request_span(span: Any, _scope: Any = None) -> None:
    """The instrumentation's ``server_request_hook``: called with each request's server
    span once its URL attributes are set, it redacts their queries."""
    attributes = getattr(span, "attributes", None) or {}
    for key in QUERY_KEYS:
        value = attributes.get(key)
        if isinstance(value, str) and value:
            span.set_attribute(key, REDACTED)
    for key in URL_KEYS:
        value = attributes.get(key)
        if isinstance(value, str) and "?" in value:
            span.set_attribute(key, redact_url(value))
