"""An image import with its progress (``POST /v1/images`` as Server-Sent Events), as a
method of :class:`~forkd.client.Controller` and of :class:`~forkd.client.AsyncController`.

Both clients send the same request (:func:`import_request`) and read the same
events (:func:`import_event`): ``progress`` events, then the image's info
(``image``), or an ``error`` last; only the reading differs.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from forkd.client.errors import ControllerError

IMPORT_TIMEOUT_SECS = 3600.0
STREAM_READ_TIMEOUT_SECS = 60.0  # the daemon sends a keep-alive every 15 s of silence

# Called with each step's message; the async client awaits what an async one returns.
ProgressCallback = Callable[[str], object]
AsyncProgressCallback = Callable[[str], Awaitable[object] | object]


def import_request(ref: str, token: str | None) -> dict[str, Any]:
    """The keywords of the streamed ``POST /v1/images`` (both clients)."""
    return {
        "json": {"ref": ref, **({"token": token} if token else {})},
        "timeout": httpx.Timeout(IMPORT_TIMEOUT_SECS, read=STREAM_READ_TIMEOUT_SECS),
        "headers": {"Accept": "text/event-stream"},
    }


def import_event(sse: ServerSentEvent) -> tuple[str | None, dict[str, Any] | None]:
    """One event of the stream: ``(message, None)`` for a step, ``(None, info)`` for the
    image at the end, ``(None, None)`` for anything else (a keep-alive, a kind this SDK
    does not know yet). An ``error`` event raises its :class:`ControllerError`."""
    if sse.event == "progress":
        return str(json.loads(sse.data).get("message", "")), None
    if sse.event == "image":
        return None, dict(json.loads(sse.data))
    if sse.event == "error":
        failure = json.loads(sse.data)
        raise ControllerError(int(failure.get("status") or 500), str(failure.get("error")), failure)
    return None, None


def _unanswered(url: str) -> ControllerError:
    return ControllerError(0, f"the forkd daemon at {url} ended the import unanswered")


def _broken(url: str, exc: httpx.TransportError) -> ControllerError:
    return ControllerError(0, f"the import stream of the forkd daemon at {url} failed: {exc!r}")


class ImageRoutes:
    """Mixed into Controller: an import that reports its steps as they happen."""

    url: str
    _client: httpx.Client

    def import_image_progress(
        self, ref: str, on_progress: ProgressCallback, token: str | None = None
    ) -> dict[str, Any]:
        """:meth:`import_image`, calling ``on_progress`` with each step (layers fetched,
        bytes, flattening) as the daemon takes it; the image's info at the end.

        A failure, before or during the import, raises :class:`ControllerError` with
        the status the daemon gave it (404 for an unknown reference, ...); a lost
        connection, status 0."""
        try:
            with self._client.stream("POST", "/v1/images", **import_request(ref, token)) as resp:
                if not resp.is_success:
                    resp.read()
                    raise ControllerError.from_response(resp)
                for sse in EventSource(resp).iter_sse():
                    message, info = import_event(sse)
                    if info is not None:
                        return info
                    if message is not None:
                        on_progress(message)
        except httpx.TransportError as exc:
            raise _broken(self.url, exc) from exc
        raise _unanswered(self.url)


class AsyncImageRoutes:
    """Mixed into AsyncController: the same import, read asynchronously."""

    url: str
    _client: httpx.AsyncClient

    async def import_image_progress(
        self, ref: str, on_progress: AsyncProgressCallback, token: str | None = None
    ) -> dict[str, Any]:
        """As :meth:`Controller.import_image_progress`; ``on_progress`` may be a plain
        function or a coroutine function (awaited before the next step is read).

        Example::

            info = await ctl.import_image_progress("oci-archive:/tmp/app.tar", print)
            await AsyncSnapshot.create("app", controller=ctl, image=info["name"])
        """
        try:
            async with self._client.stream(
                "POST", "/v1/images", **import_request(ref, token)
            ) as resp:
                if not resp.is_success:
                    await resp.aread()
                    raise ControllerError.from_response(resp)
                async for sse in EventSource(resp).aiter_sse():
                    message, info = import_event(sse)
                    if info is not None:
                        return info
                    if message is not None:
                        called = on_progress(message)
                        if inspect.isawaitable(called):
                            await called
        except httpx.TransportError as exc:
            raise _broken(self.url, exc) from exc
        raise _unanswered(self.url)
