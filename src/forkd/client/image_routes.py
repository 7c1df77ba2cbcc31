"""An image import with its progress (``POST /v1/images`` as Server-Sent Events), and
what goes to or comes from the daemon as a file: an image archive (``POST
/v1/images/load``), a volume's ext4 image (``POST /v1/volumes/import``) and a snapshot
as an OCI archive (``GET /v1/snapshots/{tag}/export``, ``POST /v1/snapshots/import``),
as methods of :class:`~forkd.client.Controller` and of
:class:`~forkd.client.AsyncController`.

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
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx
from httpx_sse import EventSource, ServerSentEvent

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.route_base import Call, RouteBase, drop_none, no_answer, quote_segment, route

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


class ImageRoutes(RouteBase):
    """Mixed into Controller: an import that reports its steps as they happen."""

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

    def import_volume(
        self,
        name: str,
        image: str | os.PathLike[str] | BinaryIO,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/volumes/import``: a volume ``name`` whose base is an ext4 file system
        image (a path, or a file open for reading in binary), sent to the daemon; its
        VolumeInfo. The file itself is never changed: sandboxes write layers of their
        own over the daemon's copy (the original forkd's ``--volume FILE.ext4:/mnt``)."""
        return self._post_file(
            "/v1/volumes/import", {"name": name}, image, "application/octet-stream", on_progress
        )

    def export_snapshot(self, tag: str, out: str | os.PathLike[str]) -> int:
        """``GET /v1/snapshots/{tag}/export``: the snapshot as an OCI archive, written to
        the file ``out`` (staged beside it and renamed into place); its size in bytes.
        The original forkd's ``pack``; :meth:`import_snapshot` is its ``unpack``."""
        target = Path(out)
        f, staged = _staged_beside(target)
        try:
            with (
                self._client.stream(
                    "GET",
                    f"/v1/snapshots/{quote(tag, safe='')}/export",
                    timeout=_long(self.timeout),
                ) as resp,
            ):
                if not resp.is_success:
                    resp.read()
                    raise ControllerError.from_response(resp)
                size = 0
                with f:
                    for piece in resp.iter_bytes(UPLOAD_PIECE):
                        f.write(piece)
                        size += len(piece)
            staged.replace(target)
        except httpx.TransportError as exc:
            f.close()
            staged.unlink(missing_ok=True)
            raise _broken(self.url, exc) from exc
        except BaseException:
            f.close()
            staged.unlink(missing_ok=True)
            raise
        return size

    def import_snapshot(
        self,
        archive: str | os.PathLike[str] | BinaryIO,
        tag: str | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/snapshots/import``: the snapshot of an archive :meth:`export_snapshot`
        wrote, named ``tag`` (default: the tag it was packed as); its SnapshotInfo."""
        params = {"tag": tag} if tag else {}
        return self._post_file(
            "/v1/snapshots/import", params, archive, "application/x-tar", on_progress
        )

    def _post_file(
        self,
        path: str,
        params: dict[str, str],
        source: str | os.PathLike[str] | BinaryIO,
        content_type: str,
        on_progress: ProgressCallback | None,
    ) -> dict[str, Any]:
        """``POST path`` with the file ``source`` as its body, sent a piece at a time (what
        was sent to ``on_progress``); the JSON answer."""
        say = on_progress or (lambda _msg: None)
        with _opened(source) as f:
            try:
                resp = self._client.post(
                    path,
                    params=params,
                    content=archive_pieces(f, say),
                    headers={"Content-Type": content_type},
                    timeout=_long(self.timeout),
                )
            except httpx.TransportError as exc:
                raise _broken(self.url, exc) from exc
        if not resp.is_success:
            raise ControllerError.from_response(resp)
        return dict(resp.json())

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


class AsyncImageRoutes(RouteBase):
    """Mixed into AsyncController: the same import, read asynchronously."""

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

    async def import_volume(
        self,
        name: str,
        image: str | os.PathLike[str] | BinaryIO,
        on_progress: AsyncProgressCallback | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Controller.import_volume`."""
        return await self._post_file(
            "/v1/volumes/import", {"name": name}, image, "application/octet-stream", on_progress
        )

    async def export_snapshot(self, tag: str, out: str | os.PathLike[str]) -> int:
        """As :meth:`Controller.export_snapshot`."""
        target = Path(out)
        f, staged = _staged_beside(target)
        try:
            async with self._client.stream(
                "GET", f"/v1/snapshots/{quote(tag, safe='')}/export", timeout=_long(self.timeout)
            ) as resp:
                if not resp.is_success:
                    await resp.aread()
                    raise ControllerError.from_response(resp)
                size = 0
                with f:
                    async for piece in resp.aiter_bytes(UPLOAD_PIECE):
                        await asyncio.to_thread(f.write, piece)
                        size += len(piece)
            staged.replace(target)
        except httpx.TransportError as exc:
            f.close()
            staged.unlink(missing_ok=True)
            raise _broken(self.url, exc) from exc
        except BaseException:
            f.close()
            staged.unlink(missing_ok=True)
            raise
        return size

    async def import_snapshot(
        self,
        archive: str | os.PathLike[str] | BinaryIO,
        tag: str | None = None,
        on_progress: AsyncProgressCallback | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Controller.import_snapshot`."""
        params = {"tag": tag} if tag else {}
        return await self._post_file(
            "/v1/snapshots/import", params, archive, "application/x-tar", on_progress
        )

    async def _post_file(
        self,
        path: str,
        params: dict[str, str],
        source: str | os.PathLike[str] | BinaryIO,
        content_type: str,
        on_progress: AsyncProgressCallback | None,
    ) -> dict[str, Any]:
        """As :meth:`ImageRoutes._post_file`, the file read off the event loop."""
        say = on_progress or (lambda _msg: None)
        with _opened(source) as f:
            try:
                resp = await self._client.post(
                    path,
                    params=params,
                    content=aarchive_pieces(f, say),
                    headers={"Content-Type": content_type},
                    timeout=_long(self.timeout),
                )
            except httpx.TransportError as exc:
                raise _broken(self.url, exc) from exc
        if not resp.is_success:
            raise ControllerError.from_response(resp)
        return dict(resp.json())

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


def _long(timeout: float) -> httpx.Timeout:
    """A transfer's timeout: the client's, but 10 minutes at least for a read (the daemon
    writes a whole pack before its first byte)."""
    return httpx.Timeout(timeout, read=max(timeout, 600))


def _staged_beside(target: Path) -> tuple[BinaryIO, Path]:
    """A new file of this process's beside ``target`` (created, never an existing name
    or a link planted there), to rename over it once whole."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    return os.fdopen(fd, "wb"), Path(name)


class ImageCalls(RouteBase):
    """The JSON routes of images (:class:`~forkd.client.routes.Routes`)."""

    @route
    def import_image(self, ref: str, token: str | None = None) -> Call[JSONDict]:
        """``POST /v1/images``: import a container image (a registry reference,
        ``docker-daemon:IMAGE``, ``docker-archive:PATH``, ``oci-archive:PATH[:tag]``,
        ``oci:DIR[:tag]``); its info with ``bytes_fetched`` and ``bytes_reused``.
        Waits up to an hour: a first import of a big image takes minutes."""
        body = drop_none({"ref": ref, "token": token})
        return self._json("POST", "/v1/images", json_body=body, timeout=max(self.timeout, 3600))

    @route
    def list_images(self) -> Call[list[JSONDict]]:
        """``GET /v1/images``: recipe and container images, sizes, shared layers, users."""
        return self._json("GET", "/v1/images")

    @route
    def image_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/images/{quote_segment(name)}")

    @route
    def delete_image(self, name: str) -> Call[None]:
        """``DELETE /v1/images/{name}``; 409 while a snapshot or sandbox uses it. Frees
        the layers no other image needs."""
        return self._request("DELETE", f"/v1/images/{quote_segment(name)}").then(no_answer)
