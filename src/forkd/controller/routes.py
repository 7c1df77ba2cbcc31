"""The routes of API v1 (docs/API.md): each translates a request model into one
service call and the service's answer into a response model."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, TypedDict

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from forkd import __version__
from forkd.controller import sse
from forkd.controller.bodies import receive_upload, stream_and_remove, stream_download
from forkd.controller.disconnect import ClientGone, unless_client_leaves
from forkd.controller.http_errors import (
    ERROR_RESPONSES,
    GUEST_STORAGE_FULL,
    HOST_DISK_RESERVE,
    IMAGE_IMPORT,
)
from forkd.controller.models import (
    SANDBOX_STATES,
    BranchRequest,
    CapacityInfo,
    CompactRequest,
    DiffResult,
    EvalInterrupt,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    ExploreRequest,
    ExploreResult,
    FileEntry,
    FileWritten,
    Health,
    ImageImport,
    ImageInfo,
    PauseRequest,
    PingResult,
    PortUrlRequest,
    PreviewInfo,
    PreviewRequest,
    ProcessInfo,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    ProcessStdin,
    PushResult,
    ResumeRequest,
    SandboxCreate,
    SandboxInfo,
    SandboxMetrics,
    SandboxUpdate,
    SnapshotCreate,
    SnapshotInfo,
    SnapshotPull,
    SnapshotPush,
    StdinWritten,
    TimeoutRequest,
    VersionInfo,
    VolumeInfo,
    WorkspaceCreate,
    WorkspaceInfo,
    WorkspaceResume,
    WorkspaceSuspend,
)
from forkd.controller.services import Services
from forkd.controller.services.images import check_loaded_tag
from forkd.errors import Invalid
from forkd.limits import NAME_PATTERN


def _services(request: Request) -> Services:
    services: Services = request.app.state.services  # Starlette's state holds Any
    return services


Svc = Annotated[Services, Depends(_services)]
PathQ = Annotated[str, Query(description="absolute path inside the sandbox")]
FormatQ = Annotated[
    Literal["file", "tar"],
    Query(description="tar: a directory's content as a tar archive (download), or extracted "
          "into the directory (upload)"),
]  # fmt: skip
OCTET_STREAM = "application/octet-stream"
TAR_MEDIA_TYPE = "application/x-tar"


# Keyword arguments shared by route decorators, typed so that each splat is checked.
class AnswerModel(TypedDict, total=False):
    response_model: Any
    response_model_exclude_unset: bool
    response_model_exclude_none: bool


class NoContent(TypedDict):
    status_code: int
    response_class: type[Response]


NO_CONTENT: NoContent = {"status_code": 204, "response_class": Response}
BYTES = {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
    "description": "the file's bytes, streamed (with Content-Length), or with format=tar "
    "a tar archive of the directory's content (chunked)",
}  # fmt: skip
SNAPSHOT: AnswerModel = {"response_model": SnapshotInfo, "response_model_exclude_unset": True}
Pid = Annotated[int, Path(ge=1, description="the process id in the guest")]
EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "Server-Sent Events: stdout, stderr, pty ({data, encoding, offset, "
    "next_offset}), gap ({from, to}), exit ({exit_code}, last), error ({error}, last)",
}

discovery = APIRouter(tags=["discovery"])
snapshots = APIRouter(prefix="/v1/snapshots", tags=["snapshots"], responses=ERROR_RESPONSES)
sandboxes = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], responses=ERROR_RESPONSES)
files = APIRouter(prefix="/v1/sandboxes", tags=["files"], responses=ERROR_RESPONSES)
processes = APIRouter(
    prefix="/v1/sandboxes/{sandbox_id}/processes", tags=["processes"], responses=ERROR_RESPONSES
)
volumes = APIRouter(prefix="/v1/volumes", tags=["volumes"], responses=ERROR_RESPONSES)
images = APIRouter(prefix="/v1/images", tags=["images"], responses=ERROR_RESPONSES)
IMPORT_EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "with Accept: text/event-stream, Server-Sent Events: progress "
    "({message}), then image (the ImageInfo), or error ({error, status}, last)",
}


# ------------------------------------------------------------------ discovery


@discovery.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(ok=True)


@discovery.get("/version", response_model=VersionInfo)
async def version() -> VersionInfo:
    return VersionInfo(version=__version__, api="v1")


@discovery.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                     "description": "Prometheus text format"}},
)  # fmt: skip
async def metrics(request: Request) -> Response:
    body = request.app.state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4")


@discovery.get("/v1/capacity", response_model=CapacityInfo, responses=ERROR_RESPONSES)
async def capacity(svc: Svc) -> CapacityInfo:
    """Room left for sandboxes, and the snapshots held: what a gateway places by."""
    return svc.snapshots.capacity()


# ------------------------------------------------------------------ snapshots


@snapshots.post("", status_code=201, **SNAPSHOT)
async def create_snapshot(svc: Svc, body: SnapshotCreate) -> SnapshotInfo:
    return await svc.snapshots.create(body)


# The list routes filter on labels with any number of ``metadata.KEY=VALUE`` parameters.
LABEL_FILTERS = {"description": "any number of metadata.KEY=VALUE parameters filter on labels"}


def _metadata_filter(request: Request, *named: str) -> dict[str, str]:
    """The ``metadata.KEY=VALUE`` filters; any parameter but those and ``named`` is a
    400, and so is one given twice: a filter ignored would list (and maybe have the
    caller act on) everything."""
    prefix = "metadata."
    labels: dict[str, str] = {}
    for key in request.query_params:
        if len(request.query_params.getlist(key)) > 1:
            raise Invalid(f"query parameter {key!r} is given more than once")
        if key.startswith(prefix) and len(key) > len(prefix):
            labels[key[len(prefix) :]] = request.query_params[key]
        elif key not in named:
            raise Invalid(f"unknown query parameter {key!r}: filter with metadata.KEY=VALUE")
    return labels


@snapshots.get(
    "",
    response_model=list[SnapshotInfo],
    response_model_exclude_unset=True,
    openapi_extra=LABEL_FILTERS,
)
async def list_snapshots(svc: Svc, request: Request) -> list[SnapshotInfo]:
    return svc.snapshots.list(metadata=_metadata_filter(request))


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
    responses={200: {"content": {"application/x-tar": {"schema": {"type": "string",
                                                                  "format": "binary"}}},
                     "description": "the snapshot as an OCI archive"}, **HOST_DISK_RESERVE},
)  # fmt: skip
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
    openapi_extra={"requestBody": {"content": {"application/x-tar": {
        "schema": {"type": "string", "format": "binary"}}}, "required": True}},
    **SNAPSHOT,
)  # fmt: skip
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


# ------------------------------------------------------------------ sandboxes


@sandboxes.post("", status_code=201, response_model=list[SandboxInfo])
async def create_sandboxes(svc: Svc, body: SandboxCreate) -> list[SandboxInfo]:
    return await svc.sandboxes.create(body)


@sandboxes.get("", response_model=list[SandboxInfo], openapi_extra=LABEL_FILTERS)
async def list_sandboxes(
    svc: Svc,
    request: Request,
    state: Annotated[
        str | None, Query(description=f"one of {', '.join(SANDBOX_STATES)}; another is a 400")
    ] = None,
    snapshot: Annotated[str | None, Query(description="forked from this snapshot")] = None,
) -> list[SandboxInfo]:
    return svc.sandboxes.list(state, snapshot, _metadata_filter(request, "state", "snapshot"))


@sandboxes.get("/metrics", response_model=list[SandboxMetrics])
async def list_sandbox_metrics(
    svc: Svc,
    request: Request,
    sandbox_ids: Annotated[
        str | None, Query(description="these sandboxes only, comma-separated")
    ] = None,
) -> list[SandboxMetrics]:
    """What every sandbox uses: the host's figures now, the guest's as last read."""
    _only_named(request, "sandbox_ids")
    every = svc.usage.all()
    if sandbox_ids is None:
        return every
    wanted = set(sandbox_ids.split(","))
    return [m for m in every if m.sandbox_id in wanted]


@sandboxes.get("/{sandbox_id}", response_model=SandboxInfo)
async def get_sandbox(svc: Svc, sandbox_id: str) -> SandboxInfo:
    return svc.sandboxes.info(sandbox_id)


@sandboxes.patch("/{sandbox_id}", response_model=SandboxInfo)
async def update_sandbox(svc: Svc, sandbox_id: str, req: SandboxUpdate) -> SandboxInfo:
    """Change whether reclaim may hibernate it (``evictable``) and whether a request
    wakes it (``auto_resume``)."""
    return svc.sandboxes.update(sandbox_id, req)


@sandboxes.get("/{sandbox_id}/metrics", response_model=SandboxMetrics)
async def sandbox_metrics(svc: Svc, sandbox_id: str) -> SandboxMetrics:
    """What the sandbox uses now: CPU, memory, disk, volumes, network, processes."""
    return await svc.usage.of(sandbox_id)


@sandboxes.delete("/{sandbox_id}", **NO_CONTENT)
async def kill_sandbox(svc: Svc, sandbox_id: str) -> Response:
    await svc.sandboxes.kill(sandbox_id)
    return Response(status_code=204)


@sandboxes.post("/{sandbox_id}/ping", response_model=PingResult)
async def ping(svc: Svc, sandbox_id: str) -> PingResult:
    return await svc.sandboxes.ping(sandbox_id)


@sandboxes.post("/{sandbox_id}/exec", response_model=ExecResult)
async def exec_(svc: Svc, sandbox_id: str, body: ExecRequest) -> ExecResult:
    return await svc.sandboxes.exec(sandbox_id, body)


@sandboxes.post("/{sandbox_id}/eval", response_model=EvalResult)
async def eval_(svc: Svc, sandbox_id: str, body: EvalRequest) -> EvalResult:
    return await svc.sandboxes.eval(sandbox_id, body)


@sandboxes.post("/{sandbox_id}/eval/interrupt", response_model=EvalInterrupt)
async def eval_interrupt(svc: Svc, sandbox_id: str) -> EvalInterrupt:
    return await svc.sandboxes.eval_interrupt(sandbox_id)


@sandboxes.post("/{sandbox_id}/timeout", response_model=SandboxInfo)
async def set_timeout(svc: Svc, sandbox_id: str, body: TimeoutRequest) -> SandboxInfo:
    """Set the sandbox's timeout to ``timeout_s`` from now (extend or shorten it), or
    remove it with null. What it does then is the fork's ``on_timeout``."""
    return svc.sandboxes.set_timeout(sandbox_id, body)


@sandboxes.post("/{sandbox_id}/pause", response_model=SandboxInfo)
async def pause(svc: Svc, sandbox_id: str, body: PauseRequest | None = None) -> SandboxInfo:
    """Stop the sandbox's vCPUs, its memory kept: it uses no CPU, answers no guest
    call (409) and can be branched as it is. 409 unless it is running. With
    ``hibernate``, a running or paused sandbox is written to disk and its QEMU ends
    (409 when it is already hibernated)."""
    await svc.pausing.pause(sandbox_id, hibernate=bool(body and body.hibernate))
    return svc.sandboxes.info(sandbox_id)


@sandboxes.post("/{sandbox_id}/resume", response_model=SandboxInfo)
async def resume(svc: Svc, sandbox_id: str, body: ResumeRequest | None = None) -> SandboxInfo:
    """Run the paused sandbox again and set its clock, or restore the hibernated one
    into a new QEMU. 409 unless it is paused or hibernated."""
    await svc.pausing.resume(sandbox_id, body.timeout_s if body else None)
    return svc.sandboxes.info(sandbox_id)


@sandboxes.post(
    "/{sandbox_id}/branch",
    status_code=201,
    responses={202: {"model": SnapshotInfo, "description": "wait false: status writing"}},
    **SNAPSHOT,
)
async def branch(
    svc: Svc, sandbox_id: str, response: Response, body: BranchRequest | None = None
) -> SnapshotInfo:
    req = body or BranchRequest()
    info = await svc.branches.branch(sandbox_id, req)
    if not req.wait:  # answered once the source runs again; written in the background
        response.status_code = 202
    return info


@sandboxes.post("/{sandbox_id}/explore", response_model=ExploreResult)
async def explore(
    svc: Svc, sandbox_id: str, body: ExploreRequest, request: Request
) -> ExploreResult | Response:
    """Branch the sandbox once, fork a child per variant, run each variant's step and
    the score in every child, keep the best ``keep`` and kill the rest; results best
    first. The source runs on. A client that goes away cancels it: nothing it made is
    left (docs/API.md, "Explore")."""
    try:
        return await unless_client_leaves(request, svc.explore.explore(sandbox_id, body))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the audit log does


DIFF_FORMATS = {
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/DiffResult"}},
        "text/x-diff": {"schema": {"type": "string"}},
        TAR_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
    },
    "description": "json: the changes; patch: a unified diff of the text files; tar: the "
    "added and modified files",
}


AGAINST = (
    "a snapshot tag or sandbox id of the same image; default the snapshot the sandbox was "
    "forked from"
)


@sandboxes.get("/{sandbox_id}/diff", response_model=DiffResult, responses={200: DIFF_FORMATS})
async def diff(
    svc: Svc,
    sandbox_id: str,
    path: Annotated[str, Query(description="the directory (or file) to compare")] = "/",
    against: Annotated[str | None, Query(description=AGAINST)] = None,
    format: Annotated[Literal["json", "patch", "tar"], Query()] = "json",
) -> DiffResult | Response:
    """What the sandbox changed under ``path``: added, modified and removed paths
    (docs/API.md, "Diff")."""
    if format == "patch":
        text = await svc.diffs.patch(sandbox_id, path, against)
        return Response(text, media_type="text/x-diff; charset=utf-8")
    if format == "tar":
        return stream_download(await svc.diffs.tar(sandbox_id, path, against), TAR_MEDIA_TYPE)
    return await svc.diffs.diff(sandbox_id, path, against)


@sandboxes.post("/{sandbox_id}/preview-urls", status_code=201, response_model=PreviewInfo)
async def preview_url(
    svc: Svc, sandbox_id: str, body: PreviewRequest, request: Request
) -> PreviewInfo:
    """A signed URL to a guest port for a browser, no bearer token: it works until it
    expires or the sandbox dies (docs/API.md, "Ports")."""
    return svc.ports.create_preview(sandbox_id, body, str(request.base_url))


@sandboxes.post("/{sandbox_id}/ports/{port}/url", status_code=201, response_model=PreviewInfo)
async def port_url(
    svc: Svc,
    sandbox_id: str,
    port: Annotated[int, Path(ge=1, le=65535, description="the guest's TCP port")],
    request: Request,
    body: PortUrlRequest | None = None,
) -> PreviewInfo:
    """The same as ``POST /v1/sandboxes/{id}/preview-urls`` with ``port`` in the path
    (the issue's form). It shadows a guest app's own ``POST /url`` on the proxy route;
    that one stays reachable through a preview URL or a tunnel."""
    req = PreviewRequest(port=port, ttl_s=(body or PortUrlRequest()).ttl_s)
    return svc.ports.create_preview(sandbox_id, req, str(request.base_url))


# ------------------------------------------------------------------ files


@files.get("/{sandbox_id}/files", response_class=Response, responses={200: BYTES})
async def read_file(svc: Svc, sandbox_id: str, path: PathQ, format: FormatQ = "file") -> Response:
    if format == "tar":
        return stream_download(await svc.files.download_tar(sandbox_id, path), TAR_MEDIA_TYPE)
    return stream_download(await svc.files.download(sandbox_id, path), OCTET_STREAM)


@files.put(
    "/{sandbox_id}/files",
    response_model=FileWritten,
    responses=GUEST_STORAGE_FULL,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}, "required": True}},
)  # fmt: skip
async def write_file(
    svc: Svc, sandbox_id: str, path: PathQ, request: Request, format: FormatQ = "file"
) -> FileWritten:
    size = await receive_upload(
        request, lambda body: svc.files.upload(sandbox_id, path, body, tar=format == "tar")
    )
    return FileWritten(path=path, size=size)


@files.delete("/{sandbox_id}/files", **NO_CONTENT)
async def remove_file(svc: Svc, sandbox_id: str, path: PathQ, recursive: bool = False) -> Response:
    await svc.sandboxes.remove_file(sandbox_id, path, recursive)
    return Response(status_code=204)


@files.get("/{sandbox_id}/files/list", response_model=list[FileEntry])
async def list_files(svc: Svc, sandbox_id: str, path: PathQ) -> list[FileEntry]:
    return await svc.sandboxes.list_files(sandbox_id, path)


# ------------------------------------------------------------------ processes


@processes.post("", status_code=201, response_model=ProcessInfo)
async def start_process(svc: Svc, sandbox_id: str, body: ProcessStart) -> ProcessInfo:
    return await svc.processes.start(sandbox_id, body)


@processes.get("", response_model=list[ProcessInfo])
async def list_processes(svc: Svc, sandbox_id: str) -> list[ProcessInfo]:
    return await svc.processes.list(sandbox_id)


@processes.get("/{pid}", response_model=ProcessInfo)
async def process_info(svc: Svc, sandbox_id: str, pid: Pid) -> ProcessInfo:
    return await svc.processes.info(sandbox_id, pid)


@processes.get("/{pid}/output", response_class=StreamingResponse, responses={200: EVENTS})
async def process_output(
    svc: Svc,
    sandbox_id: str,
    pid: Pid,
    follow: bool = True,
    offset: Annotated[int | None, Query(ge=0, description="default: Last-Event-ID, else 0")] = None,
    last_event_id: Annotated[int | None, Header(ge=0)] = None,
) -> StreamingResponse:
    """The process's output from ``offset``; with ``follow``, until it exits."""
    start = offset if offset is not None else last_event_id or 0
    events = await svc.processes.output(sandbox_id, pid, start, follow)
    return StreamingResponse(sse.framed(events), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


@processes.post("/{pid}/stdin", response_model=StdinWritten)
async def process_stdin(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessStdin) -> StdinWritten:
    return await svc.processes.write_stdin(sandbox_id, pid, body)


@processes.post("/{pid}/signal", **NO_CONTENT)
async def signal_process(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessSignal) -> Response:
    await svc.processes.signal(sandbox_id, pid, body)
    return Response(status_code=204)


@processes.post("/{pid}/resize", **NO_CONTENT)
async def resize_process(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessResize) -> Response:
    await svc.processes.resize(sandbox_id, pid, body)
    return Response(status_code=204)


# ------------------------------------------------------------------ images


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
    openapi_extra={"requestBody": {"content": {"application/x-tar": {
        "schema": {"type": "string", "format": "binary"}}}, "required": True}},
)  # fmt: skip
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


# ------------------------------------------------------------------ volumes


@volumes.get("", response_model=list[VolumeInfo])
async def list_volumes(svc: Svc) -> list[VolumeInfo]:
    return svc.volumes.list()


@volumes.post(
    "",
    status_code=201,
    response_model=VolumeInfo,
    responses=HOST_DISK_RESERVE,
    openapi_extra={"requestBody": {"content": {"application/x-tar": {
        "schema": {"type": "string", "format": "binary"}}}, "required": False}},
)  # fmt: skip
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
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}, "required": True}},
)  # fmt: skip
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


# ------------------------------------------------------------------ events

workspaces = APIRouter(prefix="/v1/workspaces", tags=["workspaces"], responses=ERROR_RESPONSES)
WORKSPACE: AnswerModel = {"response_model": WorkspaceInfo, "response_model_exclude_none": True}


@workspaces.get("", response_model=list[WorkspaceInfo], response_model_exclude_none=True)
async def list_workspaces(svc: Svc) -> list[WorkspaceInfo]:
    """The workspaces (the original forkd's), by name."""
    return svc.workspaces.list()


@workspaces.post("", status_code=201, **WORKSPACE)
async def create_workspace(svc: Svc, body: WorkspaceCreate) -> WorkspaceInfo:
    """Fork one sandbox from ``snapshot_tag`` as the workspace ``name``."""
    return await svc.workspaces.create(body)


@workspaces.get("/{name}", **WORKSPACE)
async def workspace(svc: Svc, name: str) -> WorkspaceInfo:
    return svc.workspaces.info(name)


@workspaces.delete("/{name}", status_code=204)
async def delete_workspace(svc: Svc, name: str) -> Response:
    """Kill its sandbox, whatever its state, and forget it (the source snapshot stays)."""
    await svc.workspaces.delete(name)
    return Response(status_code=204)


@workspaces.post("/{name}/suspend", **WORKSPACE)
async def suspend_workspace(
    svc: Svc, name: str, body: WorkspaceSuspend | None = None
) -> WorkspaceInfo:
    """Hibernate its sandbox: its whole state to disk, its memory given back. 400 unless
    it is running."""
    return await svc.workspaces.suspend(name)


@workspaces.post("/{name}/resume", **WORKSPACE)
async def resume_workspace(
    svc: Svc, name: str, body: WorkspaceResume | None = None
) -> WorkspaceInfo:
    """Wake its sandbox (the same id), or fork a new one from its source when it is stale.
    400 when it is running."""
    return await svc.workspaces.resume(name)


events = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)
SSE_EVENT = {  # each event of the stream, as a client's SSE parser gives it
    "type": "object",
    "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                   "data": {"type": "string", "description": "a JSON object"}},
}  # fmt: skip
LIFECYCLE_EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": SSE_EVENT}},
    "description": "Server-Sent Events, one per lifecycle event (docs/API.md, Events): event "
    "(its type), id, data ({id, type, time, sandbox_id?, snapshot_tag?, ...}); a gap "
    "({after, missed, reason}) when events it would have had were lost",
}

SINCE = "replay after this id (0: all kept); default: Last-Event-ID, else from now"


def _only_named(request: Request, *named: str) -> None:
    """Any query parameter but ``named``, or one given twice, is a 400: a filter
    ignored would stream everything."""
    for key in request.query_params:
        if len(request.query_params.getlist(key)) > 1:
            raise Invalid(f"query parameter {key!r} is given more than once")
        if key not in named:
            raise Invalid(f"unknown query parameter {key!r}: one of {', '.join(named)}")


@events.get("", response_class=StreamingResponse, responses={200: LIFECYCLE_EVENTS})
async def lifecycle_events(
    svc: Svc,
    request: Request,
    type: Annotated[str | None, Query(description="event types, comma-separated")] = None,
    sandbox_id: Annotated[str | None, Query(description="this sandbox's events only")] = None,
    since: Annotated[int | None, Query(ge=0, description=SINCE)] = None,
    last_event_id: Annotated[int | None, Header(ge=0)] = None,
) -> StreamingResponse:
    """Lifecycle events as they happen, until the daemon stops."""
    _only_named(request, "type", "sandbox_id", "since")
    types = None if type is None else type.split(",")
    start = since if since is not None else last_event_id
    stream = svc.fleet.events.subscribe(types, sandbox_id, start)
    return StreamingResponse(sse.lifecycle(stream), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


ROUTERS = (
    discovery, snapshots, sandboxes, processes, files, volumes, images, workspaces, events,
)  # fmt: skip
