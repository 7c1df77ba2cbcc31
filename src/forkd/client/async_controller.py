"""The asyncio SDK client: :class:`AsyncController`, the JSON routes of
:class:`~forkd.client.Controller` as coroutines, on ``httpx.AsyncClient``.

The routes themselves are :class:`~forkd.client.routes.Routes`, the same code the
sync client runs: here ``_request`` and ``_json`` return awaitables and ``_then``
chains onto them. A process's output and the lifecycle events are async
iterators (:mod:`forkd.client.async_streams`); terminals, guest-port WebSockets,
tunnels and streamed file transfers are in :mod:`forkd.client.async_sockets`; an
image import with its progress in :mod:`forkd.client.image_routes`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from forkd.client.async_sockets import AsyncSockets
from forkd.client.async_streams import AsyncStreams
from forkd.client.connection import asend, json_of
from forkd.client.image_routes import AsyncImageRoutes
from forkd.client.routes import Routes


class AsyncController(Routes, AsyncStreams, AsyncSockets, AsyncImageRoutes):
    """An asyncio client of the forkd daemon: the methods of :class:`Controller`'s
    JSON routes, each a coroutine with the same arguments and answer.

    Arguments as :class:`~forkd.client.Controller` (``transport``: an
    ``httpx.AsyncBaseTransport``).

    Example::

        async with AsyncController() as ctl:
            [info] = await ctl.spawn_sandboxes("py")
            print(await ctl.exec_command(info["id"], ["uname", "-r"]))
            await ctl.kill_sandbox(info["id"])
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 120.0,
        *,
        token_file: str | os.PathLike[str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        address, token = self._address(base_url, timeout, token, token_file)
        self._client = address.async_client(token, self.timeout, transport)

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._client.aclose()

    async def __aenter__(self) -> AsyncController:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncController({self.url!r})"

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Awaitable[httpx.Response]:
        return asend(
            self._client, self.url, method, path, json=json_body, params=params,
            content=content, headers=headers,
            timeout=self.timeout if timeout is None else timeout,
        )  # fmt: skip

    def _json(self, method: str, path: str, **kw: Any) -> Awaitable[Any]:
        return self._then(self._request(method, path, **kw), lambda r: json_of(r, method, path))

    def _then(self, answer: Awaitable[Any], then: Callable[[Any], Any]) -> Awaitable[Any]:
        async def chained() -> Any:
            return then(await answer)

        return chained()
