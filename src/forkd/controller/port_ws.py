"""WebSockets to a guest's TCP port: proxied WebSocket upgrades, and raw TCP tunnels.

- ``/v1/sandboxes/{id}/ports/{port}/{path}`` and ``/v1/preview/{token}/{path}``
  as WebSockets: the daemon accepts the client's socket once the guest
  accepted its own to the same path (the client gets the subprotocol the
  guest chose), then relays messages both ways, and the close.
- ``/v1/sandboxes/{id}/tunnels/{port}``: a TCP connection to the guest port;
  binary frames carry its bytes both ways (``forkd port-forward``). A text
  frame ``eof`` from the client shuts the guest's side for writing (a
  half-close); the guest's end closes the socket with 1000.

A refusal before the handshake is the HTTP error any route would answer.
Each socket holds one of its sandbox's proxied connections; all end when the
sandbox stops. OpenAPI does not describe WebSockets: docs/API.md does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import websockets
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection

from forkd import limits
from forkd.controller.http_errors import close_reason, refuse_websocket, status_of
from forkd.controller.port_proxy import (
    PREVIEW_PATH,
    PROXY_PATH,
    GuestGone,
    connect_guest,
    cookie_tag,
    guest_headers,
    guest_target,
    open_guest,
    read_watching,
)
from forkd.controller.services import Services
from forkd.controller.services.ports import GuestLink, parse_port
from forkd.errors import ForkdError, GuestError

TUNNEL_PATH = "/v1/sandboxes/{sandbox_id}/tunnels/{port}"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a message either way (uvicorn: ws_max_size)
WS_QUEUE = 1  # messages read ahead of the relay, either way (uvicorn: ws_max_queue)
CLOSE_NORMAL = 1000
CLOSE_GONE = 1001  # going away: the sandbox stopped
APP_CLOSE_BASE = 4000  # a failure after the handshake: 4000 + its HTTP status
# What the WebSocket handshake needs and sets itself: never passed on.
HANDSHAKE = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-protocol",
        b"sec-websocket-extensions",
        b"content-length",
    }
)

router = APIRouter(tags=["ports"])


def _services(websocket: WebSocket) -> Services:
    services: Services = websocket.app.state.services  # Starlette's state holds Any
    return services


async def _refuse(websocket: WebSocket, exc: ForkdError) -> None:
    await refuse_websocket(
        websocket.scope, websocket.receive, websocket.send, status_of(exc), str(exc)
    )


@router.websocket(PROXY_PATH)
async def proxy_socket(websocket: WebSocket, sandbox_id: str, port: str, path: str) -> None:
    try:  # checked here: FastAPI's check of a WebSocket's path closes it with a bare 403
        number = parse_port(port)
    except ForkdError as exc:
        await _refuse(websocket, exc)
        return
    prefix = f"/v1/sandboxes/{sandbox_id}/ports/{number}"
    await _proxy(websocket, sandbox_id, number, prefix, 5)


@router.websocket(PREVIEW_PATH)
async def preview_socket(websocket: WebSocket, token: str, path: str) -> None:
    try:
        sandbox_id, port = _services(websocket).ports.resolve_preview(token)
    except ForkdError as exc:
        await _refuse(websocket, exc)
        return
    await _proxy(websocket, sandbox_id, port, f"/v1/preview/{token}", 3)


async def _proxy(
    websocket: WebSocket, sandbox_id: str, port: int, prefix: str, segments: int
) -> None:
    scope = websocket.scope
    sent = guest_headers(scope, port, prefix, cookie_tag(websocket, prefix))
    headers = [(k, v) for k, v in sent if k.lower() not in HANDSHAKE]
    target = guest_target(scope, segments).decode("latin-1")
    try:
        by_preview = prefix.startswith("/v1/preview/")
        async with _services(websocket).ports.link(sandbox_id, port, by_preview=by_preview) as link:
            sock = await connect_guest(link)
            try:
                guest = await websockets.connect(
                    f"ws://localhost:{port}{target}",
                    sock=sock,
                    proxy=None,
                    additional_headers=[
                        (k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in headers
                        if k != b"host"
                    ],
                    subprotocols=scope.get("subprotocols") or None,
                    compression=None,
                    open_timeout=limits.PORT_HEAD_SECS,
                    max_size=MAX_MESSAGE_BYTES,
                    max_queue=WS_QUEUE,  # a client that does not read holds back the guest
                    user_agent_header=None,
                )
            except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
                sock.close()
                raise GuestError(
                    f"port {port} of sandbox {sandbox_id!r} refused the WebSocket: {exc}"
                ) from exc
            async with guest:
                await websocket.accept(subprotocol=guest.subprotocol)
                await _relay_messages(websocket, guest, link)
    except ForkdError as exc:
        if websocket.client_state.name == "CONNECTING":
            await _refuse(websocket, exc)
        else:
            await _close(websocket, APP_CLOSE_BASE + status_of(exc), str(exc))


async def _relay_messages(websocket: WebSocket, guest: ClientConnection, link: GuestLink) -> None:
    async def to_guest() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                await guest.close(message.get("code", CLOSE_NORMAL))
                return
            data = message.get("bytes")
            await guest.send(data if data is not None else message.get("text", ""))

    async def to_client() -> None:
        try:
            async for message in guest:
                if isinstance(message, bytes):
                    await websocket.send_bytes(message)
                else:
                    await websocket.send_text(message)
        except websockets.ConnectionClosed:
            pass
        code = guest.close_code
        # 1005 (no code), 1006 (no close frame), 1015 (TLS) may not be sent in a frame.
        if code is None or not 1000 <= code <= 4999 or code in (1005, 1006, 1015):
            code = CLOSE_NORMAL
        await _close(websocket, code, guest.close_reason or "")

    await _until_first(to_guest(), to_client(), _watch(link))


@router.websocket(TUNNEL_PATH)
async def tunnel_socket(websocket: WebSocket, sandbox_id: str, port: str) -> None:
    """Raw TCP to guest ``port``, its bytes in binary frames."""
    try:
        async with _services(websocket).ports.link(sandbox_id, parse_port(port)) as link:
            reader, writer = await open_guest(link)
            await websocket.accept()
            try:
                await _until_first(
                    _client_to_guest(websocket, writer), _guest_to_client(websocket, reader, link)
                )
            finally:
                writer.close()
    except ForkdError as exc:
        if websocket.client_state.name == "CONNECTING":
            await _refuse(websocket, exc)
        else:
            await _close(websocket, APP_CLOSE_BASE + status_of(exc), str(exc))


async def _client_to_guest(websocket: WebSocket, writer: asyncio.StreamWriter) -> None:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("bytes")
        if data:
            writer.write(data)
            try:
                await writer.drain()
            except OSError:
                return
        elif message.get("text") == "eof" and writer.can_write_eof():
            writer.write_eof()
            await asyncio.Event().wait()  # half-closed: the guest's side ends it


async def _guest_to_client(
    websocket: WebSocket, reader: asyncio.StreamReader, link: GuestLink
) -> None:
    try:
        while data := await read_watching(reader, link):
            await websocket.send_bytes(data)
    except OSError:
        pass
    except GuestGone:
        await _close(websocket, CLOSE_GONE, f"sandbox {link.sandbox_id} stopped")
        return
    await _close(websocket, CLOSE_NORMAL, "the guest closed the connection")


async def _watch(link: GuestLink) -> None:
    """Returns once the sandbox stopped."""
    while link.alive():
        await asyncio.sleep(2.0)


async def _until_first(*parts: Awaitable[None]) -> None:
    """Run ``parts`` until one returns; cancel the rest."""
    tasks = [asyncio.ensure_future(p) for p in parts]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
    for task in done:
        exc = task.exception()
        if exc is not None and not isinstance(exc, WebSocketDisconnect | OSError):
            raise exc


async def _close(websocket: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await websocket.close(code, close_reason(reason))
