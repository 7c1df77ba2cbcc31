"""The asyncio SDK client: :class:`AsyncController`, the JSON routes of
:class:`~forkd.client.Controller` as coroutines, on ``httpx.AsyncClient``.

The routes themselves are :class:`~forkd.client.routes.Routes`, the same code the
sync client runs: here each route's call is awaited (``_run``). A process's
output and the lifecycle events are async iterators
(:mod:`forkd.client.async_streams`); terminals, guest-port WebSockets, tunnels and
streamed file transfers are in :mod:`forkd.client.async_sockets`; an image import
with its progress in :mod:`forkd.client.image_routes`.
"""

from __future__ import annotations

import os
from typing import TypeVar

import httpx

from forkd.client.async_sockets import AsyncSockets
from forkd.client.async_streams import AsyncStreams
from forkd.client.connection import asend
from forkd.client.image_routes import AsyncImageRoutes
from forkd.client.routes import AsyncRunner, Call, Routes

T = TypeVar("T")


class AsyncController(AsyncRunner, Routes, AsyncStreams, AsyncSockets, AsyncImageRoutes):
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

    async def _run(self, call: Call[T]) -> T:
        """Send ``call`` and decode its answer (every JSON route goes through here)."""
        resp = await asend(
            self._client,
            self.url,
            call.method,
            call.path,
            json=call.json_body,
            params=call.params,
            content=call.content,
            headers=call.headers,
            timeout=self.timeout if call.timeout is None else call.timeout,
        )
        return call.decode(resp)
