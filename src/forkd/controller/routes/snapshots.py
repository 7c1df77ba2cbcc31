"""Snapshots: build, list, inspect, compact, push and pull, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from forkd.controller.bodies import receive_upload, stream_and_remove
from forkd.controller.http_errors import ERROR_RESPONSES, HOST_DISK_RESERVE
from forkd.controller.models import (
    CompactRequest,
    PushResult,
    SnapshotCreate,
    SnapshotInfo,
    SnapshotPull,
    SnapshotPush,
)
from forkd.controller.routes.common import LABEL_FILTERS, NO_CONTENT, SNAPSHOT, Svc, metadata_filter
from forkd.limits import NAME_PATTERN

snapshots = APIRouter(prefix="/v1/snapshots", tags=["snapshots"], responses=ERROR_RESPONSES)


@snapshots.post("", status_code=201, **SNAPSHOT)
async def create_snapshot(svc: Svc, body: SnapshotCreate) -> SnapshotInfo:
    return await svc.snapshots.create(body)


@snapshots.get(
    "",
    response_model=list[SnapshotInfo],
    response_model_exclude_unset=True,
    openapi_extra=LABEL_FILTERS,
)
async def list_snapshots(svc: Svc, request: Request) -> list[SnapshotInfo]:
    return svc.snapshots.list(metadata=metadata_filter(request))


@snapshots.get("/{tag}/info", **SNAPSHOT)
async def snapshot_info(svc: Svc, tag: str) -> SnapshotInfo:
    return svc.snapshots.info(tag, detailed=True)


@snapshots.get("/{tag}", **SNAPSHOT)
async def snapshot(svc: Svc, tag: str) -> SnapshotInfo:
    """The SnapshotInfo (without /info's detail): poll a pending branch here."""
    return svc.snapshots.info(tag)


@snapshots.post("/{tag}/compact", **SNAPSHOT)
async def compact_snapshot(svc: Svc, tag: str, body: CompactRequest | None = None) -> SnapshotInfo:
    """Flatten a diff snapshot's chain into a full memory.bin in place (a full one: as is);
    with ``to``, into a new full snapshot of that tag, the source untouched."""
    if body is not None and body.to is not None:
        return await svc.snapshots.compact_to(tag, body.to)
    return await svc.snapshots.compact(tag)


@snapshots.post("/{tag}/push")
async def push_snapshot(svc: Svc, tag: str, body: SnapshotPush) -> PushResult:
    """Send the snapshot to an OCI registry; only what the repository lacks goes up."""
    return await svc.transfer.push(tag, body)


@snapshots.get(
    "/{tag}/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "description": "the snapshot as an OCI archive",
        },
        **HOST_DISK_RESERVE,
    },
)
async def export_snapshot(svc: Svc, tag: str) -> StreamingResponse:
    """The snapshot as an OCI archive (an OCI image layout, tarred): what a push sends a
    registry, in a file (the original forkd's ``pack``). Import it with POST
    /v1/snapshots/import, on this host or another."""
    packed = await svc.transfer.export(tag)
    return stream_and_remove(packed, "application/x-tar", f"{tag}.forkd-snapshot.tar")


@snapshots.post(
    "/import",
    status_code=201,
    responses=HOST_DISK_RESERVE,
    openapi_extra={
        "requestBody": {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "required": True,
        }
    },
    **SNAPSHOT,
)
async def import_snapshot(
    svc: Svc,
    request: Request,
    tag: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
) -> SnapshotInfo:
    """A snapshot from an OCI archive GET .../export made (the original forkd's
    ``unpack``), streamed to disk, every blob checked; ``tag`` names it (default: the
    tag it was packed as)."""
    archive = await receive_upload(request, svc.transfer.receive_archive)
    try:
        return await svc.transfer.import_archive(archive, tag, {})
    finally:
        archive.unlink(missing_ok=True)


@snapshots.post("/pull", status_code=201, responses=HOST_DISK_RESERVE, **SNAPSHOT)
async def pull_snapshot(svc: Svc, body: SnapshotPull) -> SnapshotInfo:
    """Fetch a pushed snapshot; 409 naming every reason this host cannot restore it."""
    return await svc.transfer.pull(body)


@snapshots.delete("/{tag}", **NO_CONTENT)
async def delete_snapshot(
    svc: Svc,
    tag: str,
    cascade: Annotated[bool, Query(description="delete the diff snapshots over it too")] = False,
    force: Annotated[bool, Query(description="compact them into full ones and keep them")] = False,
) -> Response:
    await svc.snapshots.delete(tag, cascade=cascade, force=force)
    return Response(status_code=204)
