"""What every request passes through: bearer auth, body limits, the audit log."""

from __future__ import annotations

import contextlib
import hmac
import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkd.controller import console
from forkd.controller.audit import AuditLog, Fields
from forkd.controller.http_errors import (
    Respond,
    close_reason,
    error_response,
    internal_error,
    refuse_websocket,
)
from forkd.controller.services.activity import request_scope
from forkd.controller.services.waking import request_waits
from forkd.limits import FILE_BODY_LIMIT, FILE_UPLOAD_LIMIT, JSON_BODY_LIMIT, MAX_IMAGE_BYTES

UNAUDITED = ("/healthz", "/metrics")
UNAUTHORIZED = "missing or wrong bearer token"
_ID_IN_PATH = re.compile(r"^/v1/(sandboxes|snapshots)/([^/]+)")
_FILE_UPLOAD = re.compile(r"^/v1/sandboxes/[^/]+/files$")
IMAGE_LOAD = "/v1/images/load"  # an image archive a client sends: streamed to disk
VOLUME_IMPORT = "/v1/volumes/import"  # an ext4 image a client sends as a volume: the same
SNAPSHOT_IMPORT = "/v1/snapshots/import"  # a snapshot archive a client sends: the same
# The guest port proxy (controller.port_proxy): bodies are the guest's, streamed both ways.
_PROXIED = re.compile(r"^/v1/(sandboxes/[^/]+/ports/[^/]+/|preview/[^/]+/)")
# The daemon's own route under the proxy's prefix: its body is JSON, read and bounded.
_PORT_URL = re.compile(r"^/v1/sandboxes/[^/]+/ports/[^/]+/url$")
# A preview URL's token is its credential: the route checks its HMAC, and the
# audit log never records it.
_PREVIEW = re.compile(r"^/v1/preview/([^/]+)/")


def _is_raw_body_route(path: str) -> bool:
    """File uploads, a volume's content and an image as tar archives."""
    return path.endswith("/files") or path in ("/v1/volumes", IMAGE_LOAD)


def _is_streamed_upload(scope: Scope) -> bool:
    """A file upload: its body streams to the guest, never buffered here."""
    return scope["method"] == "PUT" and _FILE_UPLOAD.match(scope["path"]) is not None


def _is_image_load(scope: Scope) -> bool:
    """An image archive, or an ext4 image for a volume: its body streams to a file of
    the daemon's, never buffered (bounded by --max-image-mib and the disk reserve)."""
    streamed = (IMAGE_LOAD, VOLUME_IMPORT, SNAPSHOT_IMPORT)
    return bool(scope["method"] == "POST" and scope["path"] in streamed)


class GuardMiddleware:
    """Bearer-token auth on every route but /healthz, WebSockets too, and request body limits.

    The body limit counts the bytes that arrive, whatever ``Content-Length``
    and ``Transfer-Encoding`` claim: uvicorn frames a request that sends both
    by the chunked encoding and leaves the lying length in the headers. So
    every body is read here, within the limit, before the app is called; the
    app is handed at most the limit, and the true length in the headers.

    A file upload's body is the exception: it streams to the app as it
    arrives, counted against ``upload_limit``; past it the app reads an end
    of the body and the client gets the 413. An image archive streams the
    same way, counted against ``image_limit``. A body for a guest's port
    (``/ports/``, ``/v1/preview/``) streams uncounted: the daemon never holds it.

    ``/v1/preview/{token}/...`` needs no bearer token: its route checks the
    token's HMAC (constant time) before anything reaches a guest.
    """

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        upload_limit: int = FILE_UPLOAD_LIMIT,
        image_limit: int = MAX_IMAGE_BYTES,
        uploads: Callable[[Scope], bool] | None = None,
        typed: Callable[[Scope], bool] | None = None,
    ) -> None:
        """``uploads(scope)``: whether a request is a file upload, streamed within
        ``upload_limit`` (default: the daemon's own upload routes); ``typed(scope)``:
        whether its route reads the body's Content-Type (default: the raw-body routes);
        every other body is JSON, whatever its label."""
        self.app = app
        self.token = token.encode() if token else None
        self.upload_limit = upload_limit
        self.image_limit = image_limit
        self._is_upload = uploads or _is_streamed_upload
        self._is_typed = typed or (lambda scope: _is_raw_body_route(scope["path"]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # A handshake has no body; its frames are the route's to bound.
            if self._authorized(scope, scope["path"]):
                await self.app(scope, receive, send)
            else:
                await refuse_websocket(scope, receive, send, 401, UNAUTHORIZED)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if not self._authorized(scope, path):
            # The body is left unread; closing stops uvicorn draining it.
            await error_response(401, UNAUTHORIZED, close=True)(scope, receive, send)
            return
        if _PROXIED.match(path) and not (
            scope["method"] == "POST" and _PORT_URL.match(path)
        ):  # the daemon keeps none of it: a piece at a time
            await self.app(scope, receive, send)
            return
        streamed = self._is_upload(scope) or _is_image_load(scope)
        limit = FILE_BODY_LIMIT if _is_raw_body_route(path) else JSON_BODY_LIMIT
        if self._is_upload(scope):
            limit = self.upload_limit
        elif _is_image_load(scope):
            limit = self.image_limit
        too_big = error_response(413, f"request body over {limit} bytes", close=True)
        length = headers.get("content-length", b"")
        if length.isdigit() and int(length) > limit:  # honest and too big: no need to read it
            await too_big(scope, receive, send)
            return
        if streamed:
            await _stream_counted(self.app, scope, receive, send, limit)
            return
        try:
            body = await _read_body(receive, limit)
        except _ClientGone:
            return  # nobody to answer
        if body is None:
            await too_big(scope, receive, send)
            return
        framed = _with_body_headers(scope, len(body), self._is_typed(scope))
        await self.app(framed, _replay(body, receive), send)

    def _authorized(self, scope: Scope, path: str) -> bool:
        if self.token is None or path == "/healthz" or _PREVIEW.match(path):
            return True
        if path in console.PATHS and scope.get("method") in ("GET", "HEAD"):
            # The console's static files hold no data: see forkd.controller.console.
            return True
        given = {k.lower(): v for k, v in scope["headers"]}.get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + self.token)


async def _stream_counted(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, limit: int
) -> None:
    """Call ``app`` with the body as it arrives; past ``limit`` bytes the app sees the
    client go away, its answer is dropped, and the client gets a 413."""
    seen = 0
    cut = answered = False

    async def counted() -> Message:
        nonlocal seen, cut
        if cut:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                cut = True
                return {"type": "http.disconnect"}
        return message

    async def send_unless_cut(message: Message) -> None:
        nonlocal answered
        if not cut:
            answered = True
            await send(message)

    try:
        await app(scope, counted, send_unless_cut)
    except Exception:
        if not cut:
            raise
    if cut and not answered:
        too_big = error_response(413, f"request body over {limit} bytes", close=True)
        await too_big(scope, receive, send)


class _ClientGone(Exception):
    """The client went away before its body ended."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, counted as it arrives; None once it passes ``limit``."""
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _with_body_headers(scope: Scope, length: int, typed: bool) -> Scope:
    """``scope`` with the body's true length as its only framing header.

    Bodies of the JSON routes are JSON whatever the client labelled them
    (curl -d sends application/x-www-form-urlencoded).
    """
    drop = {b"content-length", b"transfer-encoding"}
    if not typed and scope["method"] in ("POST", "PUT", "PATCH"):
        drop.add(b"content-type")
        extra = [(b"content-type", b"application/json")]
    else:
        extra = []
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
    if length or scope["method"] in ("POST", "PUT", "PATCH"):
        extra.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers + extra}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over ``body`` in one message, then waits as ``receive`` does."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, when the client goes away

    return replay


class AuditMiddleware:
    """One JSON line per API request in the audit log (never the token).

    Outermost of the app's own middleware, it also turns an unexpected
    exception into the generic 500 with an error id (``http_errors``), so the
    audit line carries the id the client was given. Handled here, the
    exception does not reach uvicorn, which would log it a second time without
    the id and drop the connection.
    """

    def __init__(
        self,
        app: ASGIApp,
        audit: Callable[[Scope], AuditLog | None] | None = None,
        respond: Respond = error_response,
    ) -> None:
        """``audit(scope)``: the log a request goes to (default: its app's, opened in
        the app's lifespan; the E2B port writes to the daemon's); ``respond``: the
        shape of an internal error's answer (the E2B port answers as E2B does)."""
        self.app = app
        self._audit = audit or _audit_log
        self._respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: int | None = None  # stays None if no answer was sent
        error_id: str | None = None
        method = scope.get("method", "GET")  # a WebSocket handshake is a GET

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if status is None:
                status = _status_of(message)
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            if status not in (None, 101):
                raise  # the answer has begun: nothing to do but end the connection
            error_id, answer = internal_error(exc, method, scope["path"], self._respond)
            said = f"internal error (id {error_id})"
            if scope["type"] == "http":
                await answer(scope, receive, send_and_note)
            elif status is None:
                await refuse_websocket(scope, receive, send_and_note, 500, said)
            else:  # an accepted WebSocket: close it, saying why
                with contextlib.suppress(Exception):  # the client may be gone already
                    await send(
                        {"type": "websocket.close", "code": 1011, "reason": close_reason(said)}
                    )
        finally:
            audit = self._audit(scope)
            if audit is not None and scope["path"] not in UNAUDITED:
                audit.write(**_record(scope, status, started, error_id))


def _status_of(message: Message) -> int | None:
    """The status an answer's first message gives the request, if it is one.

    A WebSocket accepted is 101 (Switching Protocols); closed before it was
    accepted, the server answers 403.
    """
    kind = message["type"]
    if kind in ("http.response.start", "websocket.http.response.start"):
        return int(message["status"])
    if kind == "websocket.accept":
        return 101
    if kind == "websocket.close":
        return 403
    return None


def _record(scope: Scope, status: int | None, started: float, error_id: str | None) -> Fields:
    path: str = scope["path"]
    m = _ID_IN_PATH.match(path)
    client = scope.get("client")
    record: Fields = {
        "method": scope.get("method", "GET"),
        "path": _PREVIEW.sub("/v1/preview/<token>/", path, count=1),
        "status": status,
        "sandbox_id": m.group(2) if m and m.group(1) == "sandboxes" else None,
        "snapshot_tag": m.group(2) if m and m.group(1) == "snapshots" else None,
        "duration_ms": round((time.monotonic() - started) * 1000, 1),
        "client": client[0] if client else None,
    }
    if scope["type"] == "websocket":
        record["websocket"] = True
    if error_id is not None:
        record["error_id"] = error_id
    return record


def _audit_log(scope: Scope) -> AuditLog | None:
    """The app's audit log (opened in its lifespan), if it is open."""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, "audit", None)


WAKE_HEADER = b"forkd-wake-ms"


class SandboxRequests:
    """What a request does to the sandboxes it touches: they count as in use until it
    ends, a stream or a terminal's WebSocket included (:func:`request_scope`, for idle
    reclaim); and ``Forkd-Wake-Ms`` on the answer of one that waited for its sandbox
    to wake (forkd.controller.services.waking): the milliseconds the wake added."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        with request_scope(), request_waits() as waited:

            async def send_with_header(message: Message) -> None:
                if message["type"] == "http.response.start" and waited:
                    wake = (WAKE_HEADER, f"{sum(waited):g}".encode())
                    message = {**message, "headers": [*message.get("headers", []), wake]}
                await send(message)

            await self.app(scope, receive, send_with_header)
