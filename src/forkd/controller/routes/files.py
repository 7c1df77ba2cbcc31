"""A sandbox's files: read, write, list, remove."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response

from forkd.controller.bodies import receive_upload, stream_download
from forkd.controller.http_errors import ERROR_RESPONSES, GUEST_STORAGE_FULL
from forkd.controller.models import FileEntry, FileWritten
from forkd.controller.routes.common import NO_CONTENT, TAR_MEDIA_TYPE, Svc

PathQ = Annotated[str, Query(description="absolute path inside the sandbox")]


FormatQ = Annotated[
    Literal["file", "tar"],
    Query(
        description="tar: a directory's content as a tar archive (download), or extracted "
        "into the directory (upload)"
    ),
]


OCTET_STREAM = "application/octet-stream"


BYTES = {
    "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        "application/x-tar": {"schema": {"type": "string", "format": "binary"}},
    },
    "description": "the file's bytes, streamed (with Content-Length), or with format=tar "
    "a tar archive of the directory's content (chunked)",
}


files = APIRouter(prefix="/v1/sandboxes", tags=["files"], responses=ERROR_RESPONSES)


@files.get("/{sandbox_id}/files", response_class=Response, responses={200: BYTES})
async def read_file(svc: Svc, sandbox_id: str, path: PathQ, format: FormatQ = "file") -> Response:
    if format == "tar":
        return stream_download(await svc.files.download_tar(sandbox_id, path), TAR_MEDIA_TYPE)
    return stream_download(await svc.files.download(sandbox_id, path), OCTET_STREAM)


@files.put(
    "/{sandbox_id}/files",
    response_model=FileWritten,
    responses=GUEST_STORAGE_FULL,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "required": True,
        }
    },
)
async def write_file(
    svc: Svc, sandbox_id: str, path: PathQ, request: Request, format: FormatQ = "file"
) -> FileWritten:
    size = await receive_upload(
        request, lambda body: svc.files.upload(sandbox_id, path, body, tar=format == "tar")
    )
    return FileWritten(path=path, size=size)


@files.delete("/{sandbox_id}/files", **NO_CONTENT)
async def remove_file(svc: Svc, sandbox_id: str, path: PathQ, recursive: bool = False) -> Response:
    await svc.guest.remove_file(sandbox_id, path, recursive)
    return Response(status_code=204)


@files.get("/{sandbox_id}/files/list", response_model=list[FileEntry])
async def list_files(svc: Svc, sandbox_id: str, path: PathQ) -> list[FileEntry]:
    return await svc.guest.list_files(sandbox_id, path)
