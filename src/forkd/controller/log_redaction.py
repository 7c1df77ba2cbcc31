"""Preview tokens and secrets' values never reach the daemon's log.

A preview URL's token is its credential: anyone who reads it opens the
sandbox's port. uvicorn logs WebSocket paths (``"WebSocket /v1/preview/…" 403``)
and an unexpected error logs the request's path, so every handler of the
daemon's log gets a filter that writes ``/v1/preview/<token>`` in its place,
as the audit log does.

A secret's value is never put in a message on purpose; in case a library's
message or a traceback holds one (a header echoed by an upstream error), the
same filter writes ``<secret NAME>`` for each value :data:`SECRET_VALUES`
knows: the secret service tells it every value it holds.
"""

from __future__ import annotations

import logging
import re
import threading

MIN_REDACTED_CHARS = 4  # shorter values are no credential, and would garble every line


class SecretValues:
    """The values the daemon holds, each with its secret's name, to write out of logs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # value -> name
        self._pattern: re.Pattern[str] | None = None

    def know(self, name: str, value: str) -> None:
        with self._lock:
            self._names = {v: n for v, n in self._names.items() if n != name}
            if len(value) >= MIN_REDACTED_CHARS:
                self._names[value] = name
            self._compile()

    def forget(self, name: str) -> None:
        with self._lock:
            self._names = {v: n for v, n in self._names.items() if n != name}
            self._compile()

    def _compile(self) -> None:
        longest_first = sorted(self._names, key=len, reverse=True)
        self._pattern = (
            re.compile("|".join(re.escape(v) for v in longest_first)) if longest_first else None
        )

    def redact(self, text: str) -> str:
        pattern, names = self._pattern, self._names
        if pattern is None:
            return text
        return pattern.sub(lambda m: f"<secret {names.get(m.group(0), '?')}>", text)


SECRET_VALUES = SecretValues()

_TOKEN_IN_TEXT = re.compile(r"/v1/preview/[^/\s\"'?]+")
REDACTED = "/v1/preview/<token>"


def redact(text: str) -> str:
    return SECRET_VALUES.redact(_TOKEN_IN_TEXT.sub(REDACTED, text))


class RedactCredentials(logging.Filter):
    """Writes the record's message, arguments and traceback out with tokens and
    values redacted (an argument that is an exception is formatted first)."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it; leave it be
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(self._formatter.formatException(record.exc_info))
        return True


def install(*logger_names: str) -> None:
    """Put the filter on every handler of the root logger and of ``logger_names``."""
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactCredentials) for f in handler.filters):
                handler.addFilter(RedactCredentials())
