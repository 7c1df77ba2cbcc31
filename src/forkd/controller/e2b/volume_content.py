"""E2B's volume content API (``/volumecontent/{id}/...``, where ``E2B_VOLUME_API_URL``
points): a volume's files read and written from outside any sandbox, with the volume's
own token (``Authorization: Bearer``), as E2B's ``Volume`` instance methods call it.

The files are :class:`~.volume_files.VolumeFiles`' (every path walked by descriptor
inside the volume); each operation runs in a thread, so a slow disk never holds the
daemon's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from forkd.controller.e2b.models import Body
from forkd.controller.e2b.rest import Svc
from forkd.controller.e2b.volume_files import MAX_DEPTH, VolumeFiles, owner_of
from forkd.errors import NotFound, Unauthorized

volume_content = APIRouter(prefix="/volumecontent/{volume_id}")
FILE_MODE, DIR_MODE = 0o644, 0o755  # a new entry's, unless the request says

PathArg = Annotated[str, Query(max_length=4096)]
IdArg = Annotated[int | None, Query(ge=0, lt=1 << 32)]
ModeArg = Annotated[int | None, Query(ge=0, le=0o7777)]


def _volume_files(
    volume_id: str,
    svc: Svc,
    authorization: Annotated[str | None, Header()] = None,
) -> VolumeFiles:
    """The volume's files, if the request holds its token (else 401; an unknown volume
    is 401 too, so a token holder learns nothing of other volumes)."""
    given = (authorization or "").removeprefix("Bearer ").strip()
    try:
        volume = svc.shared_volumes.get(volume_id)
    except NotFound:
        volume = None
    if volume is not None and volume.id == volume_id:
        want = svc.ports.key.volume_token(volume.id, volume.created_at_unix)
        if given and hmac.compare_digest(want.encode(), given.encode()):
            return VolumeFiles(svc.shared_volumes.data_dir(volume))
    raise Unauthorized("that is not this volume's token (Authorization: Bearer <token>)")


Files = Annotated[VolumeFiles, Depends(_volume_files)]


class MetadataChange(Body):
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


@volume_content.get("/path")
async def stat_path(files: Files, path: PathArg) -> Response:
    return JSONResponse(await asyncio.to_thread(files.stat, path))


@volume_content.patch("/path")
async def update_path(files: Files, path: PathArg, body: MetadataChange) -> Response:
    owner = owner_of(body.uid, body.gid, body.mode, 0)
    changes = {k: owner[k] for k in ("uid", "gid", "mode") if getattr(body, k) is not None}
    return JSONResponse(await asyncio.to_thread(files.update, path, changes))


@volume_content.delete("/path", status_code=204)
async def remove_path(files: Files, path: PathArg) -> Response:
    await asyncio.to_thread(files.remove, path)
    return Response(status_code=204)


@volume_content.get("/dir")
async def list_dir(
    files: Files, path: PathArg, depth: Annotated[int, Query(ge=1, le=MAX_DEPTH)] = 1
) -> Response:
    return JSONResponse(await asyncio.to_thread(files.listing, path, depth))


@volume_content.post("/dir", status_code=201)
async def make_dir(
    files: Files,
    path: PathArg,
    uid: IdArg = None,
    gid: IdArg = None,
    mode: ModeArg = None,
    force: bool = False,
) -> Response:
    owner = owner_of(uid, gid, mode, DIR_MODE)
    made = await asyncio.to_thread(files.make_dir, path, owner, force)
    return JSONResponse(made, status_code=201)


@volume_content.get("/file")
async def read_file(files: Files, path: PathArg) -> Response:
    size = await asyncio.to_thread(files.file_size, path)  # a 404 or 400 is the answer
    chunks = files.chunks(path, size)

    async def body() -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(next, chunks, b""):
                yield chunk
        finally:
            with contextlib.suppress(ValueError):  # a read still in its thread: it closes
                chunks.close()  # the file when it is collected

    headers = {"Content-Length": str(size)}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


@volume_content.put("/file", status_code=201)
async def write_file(
    files: Files,
    request: Request,
    path: PathArg,
    uid: IdArg = None,
    gid: IdArg = None,
    mode: ModeArg = None,
    force: bool = False,  # E2B's "overwrite": an existing file is always replaced here
) -> Response:
    owner = owner_of(uid, gid, mode, FILE_MODE)
    upload = await asyncio.to_thread(files.begin_write, path, owner)
    try:
        # The body is read on the loop; only each write takes a thread, briefly: a slow
        # sender holds a connection, never one of the daemon's threads.
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(upload.write, chunk)
    except BaseException:
        await asyncio.to_thread(upload.abort)
        raise
    made = await asyncio.to_thread(upload.commit)
    return JSONResponse(made, status_code=201)
