"""The one table from error type to HTTP status, and the handlers that apply it.

Every error answer is ``{"error": message}``. The status comes from the
error's type alone (see the tree in :mod:`forkd.errors`), never its text.
No answer names a path under the daemon's own directories (state, snapshots,
run files, image cache): errors name the entry and the reason, and whatever
a host tool's message carried is cut out here, at the one place answers are
made (:func:`error_response`).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from forkd.controller.models import ErrorBody
from forkd.errors import (
    Busy,
    Conflict,
    Forbidden,
    ForkdError,
    GuestError,
    GuestStorageFull,
    Invalid,
    NoRoom,
    NotFound,
    OverCapacity,
    TimedOut,
    Unauthorized,
    Unavailable,
    UpstreamError,
)
from forkd.limits import AUDIT_FIELD_LIMIT

log = logging.getLogger(__name__)

WS_REASON_BYTES = 123  # the most a WebSocket close frame's reason may hold

STATUS: dict[type[ForkdError], int] = {
    Invalid: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    OverCapacity: 429,
    GuestError: 502,
    UpstreamError: 502,
    Busy: 503,
    Unavailable: 503,
    GuestStorageFull: 507,
    NoRoom: 507,
    TimedOut: 504,
    ForkdError: 500,
}

# For /openapi.json: what each route may answer besides its success.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in (
        (400, "bad request: body, name, size or path"),
        (401, "missing or wrong bearer token"),
        (403, "the guest, or a registry, refused for lack of permission"),
        (404, "unknown snapshot, sandbox, volume or guest path"),
        (409, "conflicts with the current state"),
        (413, "request body over the limit"),
        (429, "over a capacity cap (sandboxes, guest memory, children per request)"),
        (500, "the operation failed; the message says what was left behind"),
        (502, "the guest agent or a registry did not answer, or failed unexpectedly"),
        (503, "busy (retry shortly), or this host lacks what the request needs"),
    )
}


# Only the routes that write to the guest's disk can meet it.
GUEST_STORAGE_FULL: dict[int | str, dict[str, object]] = {
    507: {
        "model": ErrorBody,
        "description": "the guest's disk is full; nothing half-written was kept",
    }
}


# The routes that write a client's data onto the host's disk (images, volumes, pulls).
HOST_DISK_RESERVE: dict[int | str, dict[str, object]] = {
    507: {
        "model": ErrorBody,
        "description": "the host's disk would go under its --disk-reserve; nothing was kept",
    }
}
# An image import (which writes too).
IMAGE_IMPORT: dict[int | str, dict[str, object]] = {
    **HOST_DISK_RESERVE,
    504: {"model": ErrorBody, "description": "the import ran past --import-timeout"},
}


def status_of(exc: ForkdError) -> int:
    """The status of the nearest class in ``exc``'s ancestry that the table names."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


# The daemon's own directories, which no answer may name (hide_host_paths).
_hidden_roots: set[str] = set()
_hidden_pattern: re.Pattern[str] | None = None
HIDDEN_PATH = "<daemon path>"


def hide_paths_under(roots: Iterable[str | os.PathLike[str]]) -> None:
    """From now on, answers show no path under ``roots`` (this process's directories)."""
    global _hidden_pattern
    for root in roots:
        text = os.fspath(root).rstrip("/")
        if len(text) > 1:
            _hidden_roots.add(text)
            _hidden_roots.add(os.path.realpath(text))
    # A root and whatever follows it up to a space, quote or bracket: the whole path goes.
    alternatives = "|".join(re.escape(r) for r in sorted(_hidden_roots, key=len, reverse=True))
    _hidden_pattern = re.compile(f"(?:{alternatives})(?=[/\\s'\",:;)\\]]|$)[^\\s'\",:;)\\]]*")


def hide_host_paths(message: str) -> str:
    """``message`` with every path under the daemon's directories replaced."""
    if _hidden_pattern is None:
        return message
    return _hidden_pattern.sub(HIDDEN_PATH, message)


Respond = Callable[[int, str], JSONResponse]  # an error's answer: (status, message) -> body


def error_response(status: int, message: str, *, close: bool = False) -> JSONResponse:
    """``{"error": message}``; ``close`` ends the connection after it (a body left unread)."""
    headers = {"connection": "close"} if close else None
    return JSONResponse({"error": hide_host_paths(message)}, status_code=status, headers=headers)


def close_reason(message: str) -> str:
    """``message`` cut to fit a WebSocket close frame, never inside a character."""
    return hide_host_paths(message).encode()[:WS_REASON_BYTES].decode(errors="ignore")


async def refuse_websocket(
    scope: Scope, receive: Receive, send: Send, status: int, message: str
) -> None:
    """Refuse a WebSocket handshake with ``status`` and ``{"error": message}``.

    Where the server can answer a handshake with an HTTP response (ASGI's
    ``websocket.http.response`` extension; uvicorn can), the client gets
    exactly that; elsewhere the socket is closed before it is accepted, which
    the server answers with a 403, the reason unsent.
    """
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await error_response(status, message)(scope, receive, send)
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": close_reason(message)})


def internal_error(
    exc: BaseException, method: str, path: str, respond: Respond = error_response
) -> tuple[str, JSONResponse]:
    """The answer to an unexpected exception: a generic 500 and a fresh error id.

    A bug's message may carry host paths or guest output, so the client gets
    only the id to quote; the daemon log gets the traceback under that id.
    """
    error_id = secrets.token_hex(4)
    log.error(
        "internal error (id %s) in %s %s", error_id, method, path[:AUDIT_FIELD_LIMIT], exc_info=exc
    )
    message = f"internal error (id {error_id}); the daemon log has the details"
    return error_id, respond(500, message)


def install(app: FastAPI, respond: Respond = error_response) -> None:
    """Register the handlers that turn exceptions into answers: ``respond(status,
    message)`` shapes them (``{"error": ...}``; the E2B port answers as E2B does)."""

    @app.exception_handler(ForkdError)
    async def forkd_error(_r: Request, exc: ForkdError) -> JSONResponse:
        status = status_of(exc)
        if status == 500:
            log.warning("%s: %s", type(exc).__name__, exc)
        return respond(status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_r: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            if err.get("type") == "extra_forbidden":
                problems.append(f"{where}: unknown field, not supported here")
                continue
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return respond(400, "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Reached only by what escapes the audit middleware, which answers the rest.
        return internal_error(exc, request.method, request.url.path, respond)[1]
