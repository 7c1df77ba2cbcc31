"""E2B's snapshots and fork, which are forkd's branch and fork: ``create_snapshot`` branches
the running sandbox into a snapshot (paused for the capture, then resumed, its id and
lifetime unchanged); the snapshot is a template (``Sandbox.create(snapshot_id)``), listed
by ``list_snapshots`` and deleted as a template. ``fork`` branches once and forks
``count`` children of that one snapshot, each an ordinary forkd sandbox.

A snapshot here is a forkd snapshot with a source sandbox (``branched_from``): what
``forkd snapshots`` lists, which can itself be branched, explored and pushed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from forkd import limits
from forkd.controller.e2b.models import DEFAULT_TIMEOUT_S, Body
from forkd.controller.e2b.paging import paged
from forkd.controller.e2b.rest import Domain, Svc, alive, created
from forkd.controller.http_errors import hide_host_paths, status_of
from forkd.controller.models import BranchRequest, SandboxCreate, SnapshotInfo
from forkd.errors import ForkdError, NotFound
from forkd.limits import check_tag

MAX_FORKS = 20  # E2B's bound on one fork's count
MAX_PAGE = 100

snapshots_rest = APIRouter()


class SnapshotBody(Body):
    name: str | None = Field(None, max_length=64)


class ForkBody(Body):
    timeout: int | None = Field(None, ge=1, le=int(limits.MAX_SANDBOX_TIMEOUT_SECS))
    count: int = Field(1, ge=1, le=MAX_FORKS)


def _snapshot(info: SnapshotInfo) -> dict[str, object]:
    return {"snapshotID": info.tag, "names": [info.tag]}


@snapshots_rest.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(sandbox_id: str, body: SnapshotBody, svc: Svc) -> Response:
    alive(svc, sandbox_id)
    tag = check_tag(body.name) if body.name is not None else None
    info = await svc.branches.branch(sandbox_id, BranchRequest(tag=tag))
    return JSONResponse(_snapshot(info), status_code=201)


@snapshots_rest.get("/snapshots")
async def list_snapshots(
    svc: Svc,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    found = [
        info
        for info in svc.snapshots.list()
        if info.branched_from is not None
        and (sandbox_id is None or info.branched_from == sandbox_id)
        and (name is None or info.tag == name)
    ]
    found.sort(key=lambda i: (i.created_at_unix, i.tag))
    page, headers = paged(found, lambda i: i.tag, limit, next_token, "snapshot")
    return JSONResponse([_snapshot(i) for i in page], headers=headers)


@snapshots_rest.delete("/templates/{template_id:path}", status_code=204)
async def delete_template(template_id: str, svc: Svc) -> Response:
    """A snapshot (or any template) deleted; 404 for none, which E2B's SDK says is False."""
    if svc.store.get_snapshot(template_id) is None:
        raise NotFound(f"no template {template_id!r}")
    await svc.snapshots.delete(template_id)
    return Response(status_code=204)


@snapshots_rest.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, body: ForkBody, svc: Svc, domain: Domain) -> Response:
    """One branch of the sandbox, then ``count`` children of it, forked together; E2B's
    answer has an entry per child (each the same error when they could not start)."""
    alive(svc, sandbox_id)
    snapshot = await svc.branches.branch(sandbox_id, BranchRequest())
    timeout = body.timeout or DEFAULT_TIMEOUT_S
    req = SandboxCreate(snapshot_tag=snapshot.tag, n=body.count, timeout_s=timeout)
    try:
        made = await svc.sandboxes.create(req)
    except ForkdError as exc:  # none started: each fork is that error
        error = {"code": status_of(exc), "message": hide_host_paths(str(exc))}
        return JSONResponse([{"error": error}] * body.count, status_code=201)
    answer = [{"sandbox": created(svc, info, domain).model_dump(by_alias=True)} for info in made]
    return JSONResponse(answer, status_code=201)
