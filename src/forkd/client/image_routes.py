"""An image import with its progress (``POST /v1/images`` as Server-Sent Events), and
an image archive sent to the daemon (``POST /v1/images/load``), as methods of
:class:`~forkd.client.Controller` and of :class:`~forkd.client.AsyncController`.

Both clients send the same requests (:func:`import_request`, :func:`load_request`)
and read the same events (:func:`import_event`): ``progress`` events, then the
image's info (``image``), or an ``error`` last; only the reading differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx
from httpx_sse import EventSource, ServerSentEvent

from forkd.client.errors import ControllerError

IMPORT_TIMEOUT_SECS = 3600.0
UPLOAD_PIECE = 1 << 20
SAY_EVERY = 32 << 20  # an upload's progress: a step every this many bytes sent
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


def load_request(tag: str | None) -> dict[str, Any]:
    """The keywords of ``POST /v1/images/load`` but its body (both clients)."""
    return {
        "params": {"tag": tag} if tag else {},
        "timeout": httpx.Timeout(IMPORT_TIMEOUT_SECS, read=STREAM_READ_TIMEOUT_SECS),
        "headers": {"Accept": "text/event-stream", "Content-Type": "application/x-tar"},
    }


def _sent(total: int | None, done: int) -> str:
    of = f" of {total / (1 << 20):.1f}" if total else ""
    return f"sent {done / (1 << 20):.1f}{of} MiB of the archive"


def _size(f: BinaryIO) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size - f.tell()
    except (OSError, AttributeError, ValueError):
        return None


def archive_pieces(f: BinaryIO, on_progress: ProgressCallback) -> Iterator[bytes]:
    """``f``'s bytes from where it stands, a piece at a time, saying how much is sent."""
    total, done, said = _size(f), 0, 0
    while piece := f.read(UPLOAD_PIECE):
        yield piece
        done += len(piece)
        if done - said >= SAY_EVERY:
            on_progress(_sent(total, done))
            said = done
    on_progress(_sent(total, done))


async def aarchive_pieces(f: BinaryIO, on_progress: AsyncProgressCallback) -> AsyncIterator[bytes]:
    """:func:`archive_pieces` for the async client: the file is read off the event loop."""
    total, done, said = _size(f), 0, 0
    while piece := await asyncio.to_thread(f.read, UPLOAD_PIECE):
        yield piece
        done += len(piece)
        if done - said >= SAY_EVERY or done == total:
            said = done
            called = on_progress(_sent(total, done))
            if inspect.isawaitable(called):
                await called


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
        return self._stream_image("/v1/images", import_request(ref, token), on_progress)

    def load_image(
        self,
        archive: str | os.PathLike[str] | BinaryIO,
        tag: str | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/images/load``: send an image archive (``docker save``, ``podman save``,
        an OCI archive: a path, or a file open for reading in binary) and import it,
        as ``docker load`` does; the image's info. ``tag`` picks the image among several
        and names it: ``Snapshot.create(..., image=tag)`` finds it afterwards.
        ``on_progress`` hears the upload (``sent ... MiB``), then the import's steps."""
        say = on_progress or (lambda _msg: None)
        with _opened(archive) as f:
            kwargs = load_request(tag) | {"content": archive_pieces(f, say)}
            return self._stream_image("/v1/images/load", kwargs, say)

    def _stream_image(
        self, path: str, kwargs: dict[str, Any], on_progress: ProgressCallback
    ) -> dict[str, Any]:
        try:
            with self._client.stream("POST", path, **kwargs) as resp:
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
        return await self._stream_image("/v1/images", import_request(ref, token), on_progress)

    async def load_image(
        self,
        archive: str | os.PathLike[str] | BinaryIO,
        tag: str | None = None,
        on_progress: AsyncProgressCallback | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Controller.load_image`; ``on_progress`` may be a coroutine function."""
        say = on_progress or (lambda _msg: None)
        with _opened(archive) as f:
            kwargs = load_request(tag) | {"content": aarchive_pieces(f, say)}
            return await self._stream_image("/v1/images/load", kwargs, say)

    async def _stream_image(
        self, path: str, kwargs: dict[str, Any], on_progress: AsyncProgressCallback
    ) -> dict[str, Any]:
        try:
            async with self._client.stream("POST", path, **kwargs) as resp:
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


@contextlib.contextmanager
def _opened(archive: str | os.PathLike[str] | BinaryIO) -> Iterator[BinaryIO]:
    """A path opened for reading (closed after), or a file object as it is."""
    if isinstance(archive, (str, os.PathLike)):
        with Path(archive).open("rb") as f:
            yield f
    else:
        yield archive
