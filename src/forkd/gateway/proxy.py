"""Forward one request, or one WebSocket, to one node, streaming both ways.

The client's bearer token (the gateway's) is replaced by the nodes' token;
hop-by-hop headers stay behind. Bodies and answers stream through without
being held: Server-Sent Events, file downloads and uploads alike. A node that
cannot be reached is a 503 naming it (and the node set polls at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import websockets
from fastapi import Request, WebSocket
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from forkd import limits
from forkd.controller.http_errors import close_reason, error_response, refuse_websocket
from forkd.gateway.nodes import Node, NodeSet

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "authorization",
        "content-length",
    }
)
WS_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-protocol",
        "sec-websocket-extensions",
    }
)
FORWARD_TIMEOUT = httpx.Timeout(None, connect=5.0, write=60.0, pool=10.0)
CONTROL_TIMEOUT = httpx.Timeout(None, connect=5.0, write=60.0, pool=30.0)
# Connections to the nodes for relayed requests, which may stay open for as long as
# a client reads (streams, followed output, terminals): their own pool, sized as the
# gateway's own connections are, so they never hold up the gateway's own calls.
STREAM_CONNECTIONS: int | None = None  # None: limits.default_max_proxied()
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
WS_QUEUE = 1  # messages read ahead on each side of a relayed WebSocket


def node_down(node: Node) -> Response:
    return error_response(503, f"node {node.name} is down: {node.error or 'no answer'}")


class Forwarder:
    def __init__(self, nodes: NodeSet, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.nodes = nodes
        headers = {"Authorization": f"Bearer {nodes.token}"} if nodes.token else {}
        streams = STREAM_CONNECTIONS or limits.default_max_proxied()
        # Relayed requests of clients: open as long as their client reads.
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=FORWARD_TIMEOUT,
            transport=transport,
            limits=httpx.Limits(max_connections=streams, max_keepalive_connections=20),
        )
        # The gateway's own calls (lists, forks, moves): never queued behind the streams.
        self.control = httpx.AsyncClient(
            headers=headers, timeout=CONTROL_TIMEOUT, transport=transport
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.control.aclose()

    async def request(self, request: Request, node: Node) -> Response:
        """``request`` as it came, sent to ``node``; its answer streamed back."""
        if not node.up:
            return node_down(node)
        headers = [
            (k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        if not any(k.lower() == b"accept-encoding" for k, _ in headers):
            headers.append((b"accept-encoding", b"identity"))  # not httpx's own default
        upstream = self.client.build_request(
            request.method,
            node.url,
            headers=headers,
            content=request.stream() if request.method in ("POST", "PUT", "PATCH") else None,
        )
        # The path and query exactly as they came: never decoded and encoded again.
        query = request.scope.get("query_string") or b""
        raw = request.scope.get("raw_path") or request.url.path.encode()
        upstream.url = upstream.url.copy_with(raw_path=raw + (b"?" + query if query else b""))
        try:
            answer = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            self.nodes.poke(node)
            return error_response(503, f"node {node.name} did not answer: {exc}")
        response = StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            background=BackgroundTask(answer.aclose),
        )
        # Every header as the node sent it, repeated ones (Set-Cookie) too.
        response.raw_headers = [
            (k, v) for k, v in answer.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        return response

    async def json(self, node: Node, method: str, path: str, **kw: Any) -> httpx.Response:
        """A request of the gateway's own to ``node`` (not streamed)."""
        try:
            return await self.control.request(method, node.url + path, **kw)
        except httpx.HTTPError as exc:
            self.nodes.poke(node)
            raise NodeUnreachable(node, exc) from exc

    async def websocket(self, websocket: WebSocket, node: Node) -> None:
        """Bridge ``websocket`` to the same path on ``node``, messages and close both ways."""
        if not node.up:
            await refuse_websocket(
                websocket.scope, websocket.receive, websocket.send, 503, f"node {node.name} is down"
            )
            return
        raw: bytes = websocket.scope.get("raw_path") or websocket.url.path.encode()
        url = "ws" + node.url.removeprefix("http") + raw.decode("latin-1")  # as it came
        if websocket.url.query:
            url += "?" + websocket.url.query
        headers = [
            (k, v)
            for k, v in websocket.headers.items()
            if k.lower() not in HOP_BY_HOP | WS_HANDSHAKE
        ]
        if self.nodes.token:
            headers.append(("Authorization", f"Bearer {self.nodes.token}"))
        try:
            upstream = await websockets.connect(
                url,
                additional_headers=headers,
                compression=None,
                proxy=None,
                subprotocols=websocket.scope.get("subprotocols") or None,
                max_size=MAX_MESSAGE_BYTES,
                max_queue=WS_QUEUE,
                user_agent_header=None,
                open_timeout=10,
            )
        except websockets.InvalidStatus as exc:
            status = exc.response.status_code
            body = exc.response.body.decode(errors="replace")[:300] if exc.response.body else ""
            await refuse_websocket(
                websocket.scope,
                websocket.receive,
                websocket.send,
                status,
                error_text(body) or f"node {node.name} refused",
            )
            return
        except (OSError, TimeoutError, websockets.InvalidHandshake) as exc:
            self.nodes.poke(node)
            await refuse_websocket(
                websocket.scope,
                websocket.receive,
                websocket.send,
                503,
                f"node {node.name} did not answer: {exc}",
            )
            return
        async with upstream:
            await websocket.accept(subprotocol=upstream.subprotocol)
            await _relay(websocket, upstream)


class NodeUnreachable(Exception):
    def __init__(self, node: Node, exc: Exception) -> None:
        super().__init__(f"node {node.name} did not answer: {exc}")
        self.node = node


def error_text(body: str) -> str:
    """A node's error words from its ``{"error": ...}`` body ("" when it is not one)."""
    with contextlib.suppress(ValueError, AttributeError):
        return str(json.loads(body).get("error") or "")
    return ""


async def _relay(websocket: WebSocket, upstream: Any) -> None:
    async def to_node() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(message.get("code", 1000))
                return
            data = message.get("bytes")
            await upstream.send(data if data is not None else message.get("text", ""))

    async def to_client() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in upstream:
                if isinstance(message, bytes):
                    await websocket.send_bytes(message)
                else:
                    await websocket.send_text(message)
        code = upstream.close_code
        sendable = code is not None and 1000 <= code <= 4999 and code not in (1005, 1006, 1015)
        with contextlib.suppress(RuntimeError):
            await websocket.close(
                code if sendable else 1000, close_reason(upstream.close_reason or "")
            )

    tasks = [asyncio.create_task(to_node()), asyncio.create_task(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
