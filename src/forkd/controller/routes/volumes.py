"""Volumes: create, import, inspect, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from forkd.controller.bodies import receive_upload
from forkd.controller.http_errors import ERROR_RESPONSES, HOST_DISK_RESERVE
from forkd.controller.models import VolumeInfo
from forkd.controller.routes.common import NO_CONTENT, Svc
from forkd.limits import NAME_PATTERN

volumes = APIRouter(prefix="/v1/volumes", tags=["volumes"], responses=ERROR_RESPONSES)


@volumes.get("", response_model=list[VolumeInfo])
async def list_volumes(svc: Svc) -> list[VolumeInfo]:
    return svc.volumes.list()


@volumes.post(
    "",
    status_code=201,
    response_model=VolumeInfo,
    responses=HOST_DISK_RESERVE,
    openapi_extra={
        "requestBody": {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "required": False,
        }
    },
)
async def create_volume(
    svc: Svc,
    request: Request,
    name: Annotated[str, Query(pattern=NAME_PATTERN)],
    size: Annotated[str, Query(max_length=32)] = "1G",
) -> VolumeInfo:
    """An ext4 volume of ``size``; a tar archive as the body fills it."""
    return await svc.volumes.create(name, size, await request.body())


@volumes.post(
    "/import",
    status_code=201,
    response_model=VolumeInfo,
    responses=HOST_DISK_RESERVE,
    openapi_extra={
        "requestBody": {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
            "required": True,
        }
    },
)
async def import_volume(
    svc: Svc, request: Request, name: Annotated[str, Query(pattern=NAME_PATTERN)]
) -> VolumeInfo:
    """A volume whose base is the ext4 file system image sent as the body (streamed to
    disk, 16 MiB to --max-image-mib): what the original forkd's ``--volume
    FILE.ext4:/mnt`` gives."""
    return await receive_upload(request, lambda body: svc.volumes.import_image(name, body))


@volumes.get("/{name}", response_model=VolumeInfo)
async def volume_info(svc: Svc, name: str) -> VolumeInfo:
    return svc.volumes.info(name)


@volumes.delete("/{name}", **NO_CONTENT)
async def delete_volume(svc: Svc, name: str) -> Response:
    await svc.volumes.delete(name)
    return Response(status_code=204)
