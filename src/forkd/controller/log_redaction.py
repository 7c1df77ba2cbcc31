"""Preview tokens never reach the daemon's log.

A preview URL's token is its credential: anyone who reads it opens the
sandbox's port. uvicorn logs WebSocket paths (``"WebSocket /v1/preview/…" 403``)
and an unexpected error logs the request's path, so every handler of the
daemon's log gets a filter that writes ``/v1/preview/<token>`` in its place,
as the audit log does.
"""

from __future__ import annotations

import logging
import re

_TOKEN_IN_TEXT = re.compile(r"/v1/preview/[^/\s\"'?]+")
REDACTED = "/v1/preview/<token>"


def redact(text: str) -> str:
    return _TOKEN_IN_TEXT.sub(REDACTED, text)


class RedactPreviewTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def install(*logger_names: str) -> None:
    """Put the filter on every handler of the root logger and of ``logger_names``."""
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactPreviewTokens) for f in handler.filters):
                handler.addFilter(RedactPreviewTokens())
