"""Images: import, load, list, inspect, delete."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from forkd.controller import sse
from forkd.controller.bodies import receive_upload
from forkd.controller.http_errors import ERROR_RESPONSES, IMAGE_IMPORT
from forkd.controller.models import ImageImport, ImageInfo
from forkd.controller.routes.common import NO_CONTENT, Svc
from forkd.controller.services.image_requests import check_loaded_tag

images = APIRouter(prefix="/v1/images", tags=["images"], responses=ERROR_RESPONSES)


IMPORT_EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "with Accept: text/event-stream, Server-Sent Events: progress "
    "({message}), then image (the ImageInfo), or error ({error, status}, last)",
}


@images.post(
    "",
    status_code=201,
    response_model=ImageInfo,
    responses={200: IMPORT_EVENTS, **IMAGE_IMPORT},
)
async def import_image(
    svc: Svc, body: ImageImport, accept: Annotated[str | None, Header()] = None
) -> ImageInfo | Response:
    """Import a container image as a guest image (fetching only what the cache lacks)."""
    if accept and sse.MEDIA_TYPE in accept:
        return StreamingResponse(
            sse.framed(svc.images.import_events(body)),
            media_type=sse.MEDIA_TYPE,
            headers=sse.HEADERS,
        )
    return await svc.images.import_(body)


@images.post(
    "/load",
    status_code=201,
    response_model=ImageInfo,
    responses={200: IMPORT_EVENTS, **IMAGE_IMPORT},
    openapi_extra={
        "requestBody": {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "required": True,
        }
    },
)
async def load_image(
    svc: Svc,
    request: Request,
    tag: Annotated[
        str | None,
        Query(
            max_length=255,
            description="the image's name (NAME[:TAG]): picks it among "
            "several in the archive, and image=NAME finds it afterwards",
        ),
    ] = None,
    accept: Annotated[str | None, Header()] = None,
) -> ImageInfo | Response:
    """Import the image of an archive sent as the body (``docker save``, ``podman save``,
    an OCI archive), as ``docker load`` does; at most the daemon's --max-image-mib."""
    tag = check_loaded_tag(tag)
    archive = await receive_upload(request, svc.images.receive)
    if accept and sse.MEDIA_TYPE in accept:
        return StreamingResponse(
            sse.framed(svc.images.load_events(archive, tag)),
            media_type=sse.MEDIA_TYPE,
            headers=sse.HEADERS,
        )
    return await svc.images.load(archive, tag)


@images.get("", response_model=list[ImageInfo], response_model_exclude_none=True)
async def list_images(svc: Svc) -> list[ImageInfo]:
    return await asyncio.to_thread(svc.images.list)


@images.get("/{name}", response_model=ImageInfo, response_model_exclude_none=True)
async def image_info(svc: Svc, name: str) -> ImageInfo:
    return await asyncio.to_thread(svc.images.get, name)


@images.delete("/{name}", **NO_CONTENT)
async def delete_image(svc: Svc, name: str) -> Response:
    await svc.images.remove(name)
    return Response(status_code=204)
