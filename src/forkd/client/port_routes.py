"""A sandbox's TCP ports, as methods of :class:`~forkd.client.Controller`: proxy URLs,
preview URLs, WebSockets through the proxy, and raw TCP tunnels (``forkd port-forward``).

The routes are in docs/API.md, "Ports". A tunnel is a WebSocket whose binary
frames carry a TCP connection's bytes; :func:`forward_port` serves a local
listener whose every connection gets a tunnel of its own.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import wsproto.events
from httpx_ws import HTTPXWSException, WebSocketDisconnect, WebSocketSession

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.route_base import Call, RouteBase, route
from forkd.client.websockets import open_websocket, upgrade_headers

READ_BYTES = 64 * 1024


def port_route(sandbox_path: str, port: int, path: str) -> str:
    return f"{sandbox_path}/ports/{int(port)}/{path.lstrip('/')}"


def tunnel_route(sandbox_path: str, port: int) -> str:
    return f"{sandbox_path}/tunnels/{int(port)}"


class PortCalls(RouteBase):
    """The JSON routes of guest ports (:class:`~forkd.client.routes.Routes`)."""

    # -- guest ports (their WebSockets and tunnels: PortRoutes) -----------------

    def port_url(self, sandbox_id: str, port: int, path: str = "/") -> str:
        """The proxy URL of guest ``port`` at ``path`` (it needs the bearer token)."""
        return f"{self.base_url}{self._sb(sandbox_id)}/ports/{int(port)}/{path.lstrip('/')}"

    @route
    def create_preview_url(
        self, sandbox_id: str, port: int, ttl_s: int | None = None
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/preview-urls`` → ``{url, token, expires_at, port}``."""
        body: JSONDict = {"port": port}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return self._json("POST", f"{self._sb(sandbox_id)}/preview-urls", json_body=body)


class PortRoutes(PortCalls):
    """Mixed into Controller: ``/v1/sandboxes/{id}/ports``, ``preview-urls``, ``tunnels``."""

    _client: httpx.Client

    @contextlib.contextmanager
    def port_websocket(
        self, sandbox_id: str, port: int, path: str = "/", subprotocols: list[str] | None = None
    ) -> Iterator[WebSocketSession]:
        """A WebSocket to ``path`` on guest ``port``, through the proxy."""
        with self._websocket(
            port_route(self._sb(sandbox_id), port, path), upgrade_headers(subprotocols)
        ) as ws:
            yield ws

    @contextlib.contextmanager
    def open_tunnel(self, sandbox_id: str, port: int) -> Iterator[WebSocketSession]:
        """A raw TCP connection to guest ``port``: send and receive binary messages."""
        with self._websocket(tunnel_route(self._sb(sandbox_id), port), upgrade_headers()) as ws:
            yield ws

    def _websocket(self, route: str, headers: dict[str, str]) -> Any:
        return open_websocket(self._client, self.url, route, headers, timeout=self.timeout)


def bridge(conn: socket.socket, ws: WebSocketSession) -> None:
    """Carry bytes between a local TCP connection and a tunnel until either ends."""
    done = threading.Event()

    def local_to_tunnel() -> None:
        try:
            while data := conn.recv(READ_BYTES):
                ws.send_bytes(data)
            ws.send_text("eof")  # half-close: the guest may still answer
        except (OSError, HTTPXWSException):
            done.set()

    sender = threading.Thread(target=local_to_tunnel, daemon=True)
    sender.start()
    try:
        while not done.is_set():
            try:
                event = ws.receive(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(event, wsproto.events.BytesMessage):
                conn.sendall(bytes(event.data))
    except (WebSocketDisconnect, HTTPXWSException, OSError):
        pass
    finally:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()


def forward_port(
    controller: Any,
    sandbox_id: str,
    remote_port: int,
    local_port: int,
    on_ready: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    host: str = "127.0.0.1",
    on_refused: Callable[[ControllerError], None] | None = None,
) -> None:
    """Listen on ``host:local_port`` (0: any free port) and tunnel each connection to
    guest ``remote_port``, until ``stop`` is set (or forever). ``on_ready`` gets the
    port listened on. A connection the daemon refuses is closed at once, and
    ``on_refused`` told why."""
    listener = socket.create_server((host, local_port))
    listener.settimeout(0.5)
    if on_ready is not None:
        on_ready(listener.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        try:
            with controller.open_tunnel(sandbox_id, remote_port) as ws:
                bridge(conn, ws)
        except ControllerError as exc:
            conn.close()
            if on_refused is not None:
                on_refused(exc)

    with listener:
        while stop is None or not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
