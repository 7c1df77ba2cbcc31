"""Opening a WebSocket to the daemon over the SDK's own httpx client (httpx-ws).

The terminal (``…/processes/{pid}/pty``), a guest port through the proxy and a
TCP tunnel all upgrade the same way: the client's connection, auth and base
URL are reused, and a refusal (no upgrade) raises :class:`ControllerError`
with the daemon's status and message.
"""

from __future__ import annotations

import base64
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from httpx_ws import AsyncWebSocketSession, WebSocketSession

from forkd.client.errors import ControllerError


def upgrade_headers(protocols: list[str] | None = None) -> dict[str, str]:
    """The headers of a WebSocket handshake (with ``protocols`` offered, if any)."""
    headers = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Key": base64.b64encode(secrets.token_bytes(16)).decode(),
        "Sec-WebSocket-Version": "13",
    }
    if protocols:
        headers["Sec-WebSocket-Protocol"] = ", ".join(protocols)
    return headers


@contextlib.contextmanager
def open_websocket(
    client: httpx.Client,
    daemon_url: str,
    route: str,
    headers: dict[str, str],
    params: dict[str, Any] | None = None,
    timeout: Any = httpx.USE_CLIENT_DEFAULT,
) -> Iterator[WebSocketSession]:
    """A WebSocket to ``route`` on the daemon, for the block."""
    try:
        with client.stream("GET", route, params=params, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 101:
                resp.read()
                raise ControllerError.from_response(resp)
            with WebSocketSession(resp.extensions["network_stream"], response=resp) as ws:
                yield ws
    except httpx.TransportError as exc:
        raise ControllerError(
            0, f"the WebSocket to the forkd daemon at {daemon_url} ({route}) failed: {exc!r}"
        ) from exc


@contextlib.asynccontextmanager
async def aopen_websocket(
    client: httpx.AsyncClient,
    daemon_url: str,
    route: str,
    headers: dict[str, str],
    params: dict[str, Any] | None = None,
    timeout: Any = httpx.USE_CLIENT_DEFAULT,
) -> AsyncIterator[AsyncWebSocketSession]:
    """:func:`open_websocket` for an async client. httpx-ws runs the session in a task
    group, which wraps what the block raises in an ExceptionGroup: a single exception
    comes out as itself."""
    try:
        async with client.stream(
            "GET", route, params=params, headers=headers, timeout=timeout
        ) as resp:
            if resp.status_code != 101:
                await resp.aread()
                raise ControllerError.from_response(resp)
            async with AsyncWebSocketSession(
                resp.extensions["network_stream"], response=resp
            ) as ws:
                yield ws
    except httpx.TransportError as exc:
        raise ControllerError(
            0, f"the WebSocket to the forkd daemon at {daemon_url} ({route}) failed: {exc!r}"
        ) from exc
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
