"""The streaming routes for :class:`~forkd.client.AsyncController`: a process's output
and the lifecycle events, as async iterators.

The requests and the parsing are the sync client's (``process_routes._event``,
``event_routes.stream_request``, ``parse``, ``next_wait``); only the reading is
async. A terminal (``/pty``) and port tunnels are the sync client's only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import httpx
from httpx_sse import EventSource

from forkd.client import event_routes
from forkd.client.errors import ControllerError
from forkd.client.event_routes import Event
from forkd.client.process_routes import STREAM_READ_TIMEOUT_SECS, ProcessCalls, _event
from forkd.client.results import OutputEvent


class AsyncStreams(ProcessCalls):
    """Mixed into AsyncController: output and event streams."""

    _client: httpx.AsyncClient

    async def process_output(
        self, sandbox_id: str, pid: int, offset: int = 0, follow: bool = True
    ) -> AsyncIterator[OutputEvent]:
        """As :meth:`Controller.process_output`, read asynchronously."""
        params = {"offset": offset, "follow": "true" if follow else "false"}
        timeout = httpx.Timeout(self.timeout, read=max(self.timeout, STREAM_READ_TIMEOUT_SECS))
        path = f"{self._procs(sandbox_id, pid)}/output"
        try:
            async with self._client.stream(
                "GET",
                path,
                params=params,
                headers={"Accept": "text/event-stream"},
                timeout=timeout,
            ) as resp:
                if not resp.is_success:
                    await resp.aread()
                    raise ControllerError.from_response(resp)
                async for sse in EventSource(resp).aiter_sse():
                    if sse.data:  # a keep-alive after an id: no event
                        yield _event(sse)
        except httpx.TransportError as exc:
            raise ControllerError(
                0, f"the output stream of the forkd daemon at {self.url} failed: {exc!r}"
            ) from exc

    async def events(
        self,
        types: Iterable[str] | str | None = None,
        sandbox_id: str | None = None,
        since: int | None = None,
        reconnect_s: float = 30.0,
    ) -> AsyncGenerator[Event, None]:
        """As :meth:`Controller.events`: without end, reconnecting from the last id."""
        params = event_routes.event_params(types, sandbox_id)
        position, failing_since = since, None
        wait = event_routes.RECONNECT_FIRST_WAIT_SECS
        while True:
            if position is not None:
                params["since"] = position
            try:
                async for event_id, event in self._event_stream(params):
                    failing_since, wait = None, event_routes.RECONNECT_FIRST_WAIT_SECS
                    position = event_id
                    if event is not None:
                        yield event
            except httpx.TransportError as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= reconnect_s:
                    raise ControllerError(
                        0, f"the event stream of the forkd daemon at {self.url} failed: {exc!r}"
                    ) from exc
            await asyncio.sleep(wait)
            wait = event_routes.next_wait(wait)

    async def _event_stream(
        self, params: dict[str, Any]
    ) -> AsyncIterator[tuple[int, Event | None]]:
        request = event_routes.stream_request(params, self.timeout)
        async with self._client.stream("GET", "/v1/events", **request) as resp:
            if not resp.is_success:
                await resp.aread()
                raise ControllerError.from_response(resp)
            async for sse in EventSource(resp).aiter_sse():
                parsed = event_routes.parse(sse)
                if parsed is not None:
                    yield parsed
