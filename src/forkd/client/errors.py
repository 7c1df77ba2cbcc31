"""The one error the SDK raises: the daemon answered with an error, or could not be reached."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


class ControllerError(Exception):
    """The daemon answered with an error, or could not be reached.

    ``status`` is the HTTP status, or 0 when no HTTP answer came back (daemon
    not reachable, connection dropped, client-side timeout, unreadable token
    file). ``body`` is the parsed JSON body (or its text), ``message`` the
    body's ``error`` field when present.

    Example::

        try:
            ctl.get_sandbox("sb-nope")
        except ControllerError as exc:
            print(exc.status, exc.message)   # 404 unknown sandbox sb-nope
    """

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body

    @property
    def unreachable(self) -> bool:
        """True when no HTTP answer came back (``status == 0``)."""
        return self.status == 0

    @classmethod
    def from_response(cls, resp: httpx.Response) -> ControllerError:
        body: Any
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        message = None
        if isinstance(body, dict):
            if isinstance(body.get("error"), str):
                message = body["error"]
            elif "detail" in body:  # FastAPI's default error shape
                detail = body["detail"]
                message = detail if isinstance(detail, str) else json.dumps(detail)
        elif isinstance(body, str) and body.strip():
            message = body.strip()[:500]
        if not message:
            message = resp.reason_phrase or "error"
        return cls(resp.status_code, message, body)
