"""Sandboxes: fork, list, inspect, change, pause and resume, the guest's calls, branch,
explore, diff and ports."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from forkd.controller.bodies import stream_download
from forkd.controller.disconnect import ClientGone, unless_client_leaves
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models import (
    SANDBOX_STATES,
    BranchRequest,
    DiffResult,
    EvalInterrupt,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    ExploreRequest,
    ExploreResult,
    PauseRequest,
    PingResult,
    PortUrlRequest,
    PreviewInfo,
    PreviewRequest,
    ResumeRequest,
    SandboxCreate,
    SandboxInfo,
    SandboxMetrics,
    SandboxUpdate,
    SnapshotInfo,
    TimeoutRequest,
)
from forkd.controller.routes.common import (
    LABEL_FILTERS,
    NO_CONTENT,
    SNAPSHOT,
    TAR_MEDIA_TYPE,
    Svc,
    metadata_filter,
    only_named,
)

sandboxes = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"], responses=ERROR_RESPONSES)


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
    return svc.sandboxes.list(state, snapshot, metadata_filter(request, "state", "snapshot"))


@sandboxes.get("/metrics", response_model=list[SandboxMetrics])
async def list_sandbox_metrics(
    svc: Svc,
    request: Request,
    sandbox_ids: Annotated[
        str | None, Query(description="these sandboxes only, comma-separated")
    ] = None,
) -> list[SandboxMetrics]:
    """What every sandbox uses: the host's figures now, the guest's as last read."""
    only_named(request, "sandbox_ids")
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
async def kill_sandbox(
    svc: Svc,
    sandbox_id: str,
    force: Annotated[bool, Query(description="without running its stop hook")] = False,
) -> Response:
    """Kill it; its stop hook (``on_stop``) runs first unless ``force``."""
    await svc.sandboxes.kill(sandbox_id, force=force)
    return Response(status_code=204)


@sandboxes.post("/{sandbox_id}/ping", response_model=PingResult)
async def ping(svc: Svc, sandbox_id: str) -> PingResult:
    return await svc.guest.ping(sandbox_id)


@sandboxes.post("/{sandbox_id}/exec", response_model=ExecResult)
async def exec_(svc: Svc, sandbox_id: str, body: ExecRequest) -> ExecResult:
    return await svc.guest.exec(sandbox_id, body)


@sandboxes.post("/{sandbox_id}/eval", response_model=EvalResult)
async def eval_(svc: Svc, sandbox_id: str, body: EvalRequest) -> EvalResult:
    return await svc.guest.eval(sandbox_id, body)


@sandboxes.post("/{sandbox_id}/eval/interrupt", response_model=EvalInterrupt)
async def eval_interrupt(svc: Svc, sandbox_id: str) -> EvalInterrupt:
    return await svc.guest.eval_interrupt(sandbox_id)


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
