"""The WebSocket and streamed-file parts of the async SDK: terminals, a guest port's
WebSocket, TCP tunnels, and file transfers that never hold a whole file.

Each mirrors its sync counterpart (``pty.PtyHandle``, ``PortRoutes.port_websocket``
and ``open_tunnel``, ``FileRoutes.upload_file`` and ``download_file``) and shares
its frame handling, routes and checks; only the reading and writing are awaited.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

import httpx
from httpx_ws import AsyncWebSocketSession, HTTPXWSException, WebSocketDisconnect

from forkd.client.connection import JSONDict, json_of
from forkd.client.errors import ControllerError
from forkd.client.file_routes import CHUNK_BYTES, file_request
from forkd.client.port_routes import port_route, tunnel_route
from forkd.client.process_routes import ProcessCalls
from forkd.client.pty import DataCallback, PtyState, resize_message
from forkd.client.websockets import aopen_websocket, upgrade_headers

if TYPE_CHECKING:
    from forkd.client.async_controller import AsyncController

Body = bytes | bytearray | memoryview | Iterable[bytes] | AsyncIterable[bytes]


class AsyncSockets(ProcessCalls):
    """Mixed into AsyncController: files, terminals and port tunnels, streamed."""

    _client: httpx.AsyncClient

    def _websocket(
        self, route: str, headers: dict[str, str], params: dict[str, Any] | None = None
    ) -> contextlib.AbstractAsyncContextManager[AsyncWebSocketSession]:
        return aopen_websocket(self._client, self.url, route, headers, params, self.timeout)

    def port_websocket(
        self, sandbox_id: str, port: int, path: str = "/", subprotocols: list[str] | None = None
    ) -> contextlib.AbstractAsyncContextManager[AsyncWebSocketSession]:
        """``async with``: a WebSocket to ``path`` on guest ``port``, through the proxy."""
        return self._websocket(
            port_route(self._sb(sandbox_id), port, path), upgrade_headers(subprotocols)
        )

    def open_tunnel(
        self, sandbox_id: str, port: int
    ) -> contextlib.AbstractAsyncContextManager[AsyncWebSocketSession]:
        """``async with``: a raw TCP connection to guest ``port`` (binary messages)."""
        return self._websocket(tunnel_route(self._sb(sandbox_id), port), upgrade_headers())

    def pty_socket(
        self, sandbox_id: str, pid: int, offset: int = 0
    ) -> contextlib.AbstractAsyncContextManager[AsyncWebSocketSession]:
        """``async with``: the WebSocket of process ``pid``'s terminal, from ``offset``."""
        route = f"{self._procs(sandbox_id, pid)}/pty"
        return self._websocket(route, upgrade_headers(), {"offset": offset})

    async def upload_file(
        self, sandbox_id: str, path: str, content: Body, *, tar: bool = False
    ) -> JSONDict:
        """As ``Controller.upload_file``; ``content`` may be an async iterable of chunks."""
        params = {"path": path, "format": "tar" if tar else "file"}
        if isinstance(content, bytes | bytearray | memoryview):  # not iterated: ints
            body: bytes | AsyncIterator[bytes] = bytes(content)
        else:
            body = _async_chunks(content)
        async with self._streamed("PUT", f"{self._sb(sandbox_id)}/files", params, body) as resp:
            await resp.aread()
            answer: JSONDict = json_of(resp, "PUT", "/files")
            return answer

    @contextlib.asynccontextmanager
    async def download_file(
        self, sandbox_id: str, path: str, *, tar: bool = False
    ) -> AsyncIterator[tuple[int | None, AsyncIterator[bytes]]]:
        """As ``Controller.download_file``: ``async with`` gives ``(size, chunks)``."""
        params = {"path": path, "format": "tar" if tar else "file"}
        async with self._streamed("GET", f"{self._sb(sandbox_id)}/files", params, None) as resp:
            length = resp.headers.get("content-length")
            size = int(length) if length is not None and length.isdigit() else None
            yield size, _checked(resp, size)

    @contextlib.asynccontextmanager
    async def _streamed(
        self, method: str, path: str, params: dict[str, Any], body: Any
    ) -> AsyncIterator[httpx.Response]:
        request = file_request(self._client, method, path, params, body, self.timeout)
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ControllerError(0, f"{method} {path} to {self.url} failed: {exc!r}") from exc
        try:
            if not resp.is_success:
                await resp.aread()
                raise ControllerError.from_response(resp)
            yield resp
        finally:
            await resp.aclose()


async def _async_chunks(chunks: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            if chunk:
                yield bytes(chunk)
    else:
        for chunk in chunks:
            if chunk:
                yield bytes(chunk)


async def _checked(resp: httpx.Response, size: int | None) -> AsyncIterator[bytes]:
    got = 0
    try:
        async for chunk in resp.aiter_bytes(CHUNK_BYTES):
            got += len(chunk)
            yield chunk
    except httpx.TransportError as exc:
        raise ControllerError(0, f"the download broke off after {got} bytes: {exc!r}") from exc
    if size is not None and got != size:
        raise ControllerError(0, f"the download ended after {got} of {size} bytes")


class AsyncPtyHandle(PtyState):
    """A process in a terminal, over a WebSocket (see ``PtyHandle``); made by
    ``await sb.pty.create()`` or ``connect()``, closed by ``close()`` or ``async with``."""

    def __init__(
        self,
        controller: AsyncController,
        sandbox_id: str,
        pid: int,
        offset: int,
        on_data: DataCallback | None,
    ) -> None:
        super().__init__(sandbox_id, pid, offset, on_data)
        self._controller = controller
        self._stack = contextlib.AsyncExitStack()
        self._ws: AsyncWebSocketSession | None = None

    async def _open(self) -> AsyncPtyHandle:
        socket = self._controller.pty_socket(self.sandbox_id, self.pid, self.offset)
        self._ws = await self._stack.enter_async_context(socket)
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._output()

    async def _output(self) -> AsyncIterator[bytes]:
        while (data := await self.read()) is not None:
            yield data

    async def read(self, timeout: float | None = None) -> bytes | None:
        """The next piece of output; None once the process exited (``b""`` after
        ``timeout`` seconds without any)."""
        assert self._ws is not None
        while not self.exited:
            try:
                event = await self._ws.receive(timeout)
            except TimeoutError:
                return b""
            except WebSocketDisconnect as exc:
                raise self._closed(exc.code, exc.reason) from None
            except HTTPXWSException as exc:
                raise ControllerError(0, f"the terminal socket broke: {exc!r}") from exc
            data = self._frame(event)
            if data is not None:
                return data
        return None

    async def wait(self) -> int | None:
        async for _ in self:
            pass
        return self.exit_code

    async def send_stdin(self, data: str | bytes) -> None:
        assert self._ws is not None
        await self._ws.send_bytes(data.encode() if isinstance(data, str) else data)

    async def resize(self, cols: int, rows: int) -> None:
        assert self._ws is not None
        await self._ws.send_text(resize_message(cols, rows))

    async def kill(self) -> bool:
        try:
            await self._controller.signal_process(self.sandbox_id, self.pid, "SIGKILL")
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def close(self) -> None:
        """Disconnect; the process runs on (see :meth:`kill`)."""
        await self._stack.aclose()

    async def __aenter__(self) -> AsyncPtyHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
