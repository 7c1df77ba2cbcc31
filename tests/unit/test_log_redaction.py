"""Preview tokens are written as <token> by every handler of the daemon's log."""

from __future__ import annotations

import io
import logging

from forkd.controller import log_redaction

TOKEN = "p1.sb-abc-0001.8000.9999999999.AAAAsecretMAC"


def test_a_token_in_a_message_or_its_arguments_is_redacted() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("uvicorn.error.test-redaction")
    logger.addHandler(handler)
    logger.propagate = False
    log_redaction.install("uvicorn.error.test-redaction")
    try:
        logger.warning('%s - "WebSocket %s" %d', "127.0.0.1:5", f"/v1/preview/{TOKEN}/ws", 403)
        logger.error(f"internal error on GET /v1/preview/{TOKEN}/x?y=1")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert TOKEN not in text and "secretMAC" not in text
    assert '"WebSocket /v1/preview/<token>/ws" 403' in text
    assert "GET /v1/preview/<token>/x?y=1" in text
