"""What every request passes through: bearer auth, body limits, the audit log."""

from __future__ import annotations

import hmac
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkd.controller.audit import AuditLog
from forkd.controller.http_errors import error_response
from forkd.limits import FILE_BODY_LIMIT, JSON_BODY_LIMIT

UNAUDITED = ("/healthz", "/metrics")
_ID_IN_PATH = re.compile(r"^/v1/(sandboxes|snapshots)/([^/]+)")


def _is_raw_body_route(path: str) -> bool:
    """File uploads, and a volume's content as a tar archive."""
    return path.endswith("/files") or path == "/v1/volumes"


class GuardMiddleware:
    """Bearer-token auth on every route but /healthz, and request body limits."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode().lower(): v for k, v in scope["headers"]}
        if self.token is not None and path != "/healthz":
            given = headers.get("authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.token):
                await error_response(401, "missing or wrong bearer token")(scope, receive, send)
                return
        raw = _is_raw_body_route(path)
        limit = FILE_BODY_LIMIT if raw else JSON_BODY_LIMIT
        has_body = scope["method"] in ("POST", "PUT", "PATCH")
        if not raw and has_body:
            # Bodies of the JSON routes are JSON whatever the client labelled
            # them (curl -d sends application/x-www-form-urlencoded).
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k.lower() != b"content-type"
            ] + [(b"content-type", b"application/json")]
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(413, f"request body over {limit} bytes")(scope, receive, send)
            return
        if length is not None or not has_body:
            await self.app(scope, receive, send)
            return
        body = await _read_chunked(receive, limit)
        if body is None:  # over the limit, or the client went away
            await error_response(413, f"request body over {limit} bytes")(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _read_chunked(receive: Receive, limit: int) -> bytes | None:
    """A chunked body (no Content-Length), read here within ``limit``; None if over."""
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None  # the client went away
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class AuditMiddleware:
    """One JSON line per API request in the audit log (never the token)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            audit = _audit_log(scope)
            path: str = scope["path"]
            if audit is not None and path not in UNAUDITED:
                m = _ID_IN_PATH.match(path)
                client = scope.get("client")
                audit.write(
                    method=scope["method"],
                    path=path,
                    status=status,
                    sandbox_id=m.group(2) if m and m.group(1) == "sandboxes" else None,
                    snapshot_tag=m.group(2) if m and m.group(1) == "snapshots" else None,
                    duration_ms=round((time.monotonic() - started) * 1000, 1),
                    client=client[0] if client else None,
                )


def _audit_log(scope: Scope) -> AuditLog | None:
    """The app's audit log (opened in its lifespan), if it is open."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "audit", None)
