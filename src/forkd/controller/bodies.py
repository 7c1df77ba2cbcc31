"""Raw bodies that stream: an upload's request body in, a download's response body out.

The file routes hand these to :mod:`forkd.controller.services.file_transfer`,
which sees only async iterators of bytes and never HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from forkd.controller.services.file_transfer import Download
from forkd.errors import ForkdError, Invalid

T = TypeVar("T")


async def _pieces(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for piece in stream:
            if piece:
                yield piece
    except ClientDisconnect:
        raise Invalid("the request body ended early: the client went away") from None


async def receive_upload(
    request: Request, take: Callable[[AsyncIterator[bytes]], Awaitable[T]]
) -> T:
    """``take(body)``, the request body as it arrives; its answer.

    When ``take`` fails, the rest of the body is read and dropped before the
    error answer goes out: a client still sending would otherwise meet a
    closed connection instead of the answer (a 507 when the guest's disk is
    full). The guard middleware bounds how much that can be.
    """
    stream = request.stream()
    try:
        return await take(_pieces(stream))
    except ForkdError:
        with contextlib.suppress(ClientDisconnect, RuntimeError):
            async for _ in stream:
                pass
        raise


def stream_download(download: Download, media_type: str) -> StreamingResponse:
    """The download's chunks as they are read, with a Content-Length when it is known."""
    headers = {"content-length": str(download.size)} if download.size is not None else None
    return StreamingResponse(download.chunks, media_type=media_type, headers=headers)


FILE_PIECE = 1 << 20  # a file the daemon made for a client is sent this much at once


def stream_and_remove(path: Path, media_type: str, filename: str) -> StreamingResponse:
    """The file ``path`` (the daemon's, made for this answer) as the answer, removed once
    it was sent, or the client went away."""
    size = path.stat().st_size

    async def pieces() -> AsyncIterator[bytes]:
        try:
            with path.open("rb") as f:
                while piece := await asyncio.to_thread(f.read, FILE_PIECE):
                    yield piece
        finally:
            path.unlink(missing_ok=True)

    headers = {
        "content-length": str(size),
        "content-disposition": f'attachment; filename="{filename}"',
    }
    # Removed after the answer too, should the client go before its body began (a daemon
    # that dies first removes such .partial- files at its next start).
    gone = BackgroundTask(path.unlink, missing_ok=True)
    return StreamingResponse(pieces(), media_type=media_type, headers=headers, background=gone)
