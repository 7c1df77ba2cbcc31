"""E2B's REST API (its control plane) over the daemon's services: a sandbox created
from a template (a forkd snapshot tag), described, listed, given a new timeout, paused
(hibernated: E2B's pause keeps memory), connected to (woken) and killed."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.models import (
    DEFAULT_TIMEOUT_S,
    ConnectBody,
    ListedSandbox,
    NetworkUpdate,
    NewSandbox,
    RefreshBody,
    Sandbox,
    SandboxDetail,
    SandboxLifecycle,
    TimeoutBody,
    bad_env_name,
)
from forkd.controller.e2b.network_map import policy_of
from forkd.controller.e2b.paging import paged
from forkd.controller.models import SandboxCreate, SandboxInfo, TimeoutRequest
from forkd.controller.services import Services
from forkd.controller.services.shared_volumes import ShareMount
from forkd.errors import Conflict, ForkdError, Invalid, NotFound, SnapshotError, Unavailable
from forkd.states import OnTimeout, SandboxState
from forkd.vmm.snapshot import files as snapshot_files

NO_END = "9999-12-31T23:59:59.000+00:00"  # endAt of a sandbox without a timeout
MAX_PAGE = 100  # sandboxes in one page of a listing

rest = APIRouter()


def services(request: Request) -> Services:
    """The daemon's services (the E2B app shares the daemon's, made at its start)."""
    return daemon_services(request.app.state.daemon)


def daemon_services(daemon: FastAPI) -> Services:
    found: Services | None = getattr(daemon.state, "services", None)
    if found is None:
        raise Unavailable("the daemon is starting: retry shortly")
    return found


Svc = Annotated[Services, Depends(services)]
# What E2B's create takes that forkd does not serve: refused, never silently dropped.
UNSERVED = {
    "mcp": "mcp: E2B's MCP gateway is not in forkd's images (forkd mcp serves forkd's own)",
    "iam": "iam: workload identity tokens are not served by forkd",
}
_ALIVE = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.HIBERNATED)


def _e2b_state(info: SandboxInfo) -> str:
    return "running" if info.state in (SandboxState.RUNNING, SandboxState.STARTING) else "paused"


def alive(svc: Services, sandbox_id: str) -> SandboxInfo:
    """The sandbox, unless it is gone: E2B knows no dead sandboxes (404)."""
    info = svc.sandboxes.info(sandbox_id)
    if info.state == SandboxState.DEAD:
        raise NotFound(f"sandbox {sandbox_id!r} not found")
    return info


def _access_token(svc: Services, info: SandboxInfo) -> str:
    return svc.ports.key.access_token(info.id, info.created_at_unix)


def e2b_domain(request: Request) -> str | None:
    """Where ``sandbox.get_host(port)`` points (:mod:`.guest_hosts`), if anywhere."""
    found: str | None = getattr(request.app.state, "e2b_domain", None)
    return found


Domain = Annotated[str | None, Depends(e2b_domain)]


def created(svc: Services, info: SandboxInfo, domain: str | None) -> Sandbox:
    token = _access_token(svc, info)
    return Sandbox(
        template_id=info.snapshot_tag,
        sandbox_id=info.id,
        envd_access_token=token,
        traffic_access_token=token,
        domain=domain,
    )


def _listed(
    svc: Services,
    info: SandboxInfo,
    machine: tuple[int, int],
    shape: type[ListedSandbox] = ListedSandbox,
) -> Any:
    """``info`` in E2B's shape; ``machine``: its snapshot's vCPUs and MiB (:func:`machine`)."""
    vcpus, memory_mib = machine
    fields: dict[str, Any] = {
        "template_id": info.snapshot_tag,
        "sandbox_id": info.id,
        "started_at": _iso(info.created_at_unix),
        "end_at": info.expires_at or NO_END,
        "cpu_count": vcpus,
        "memory_mb": memory_mib,
        "state": _e2b_state(info),
        "metadata": info.metadata,
    }
    if shape is SandboxDetail:
        fields["envd_access_token"] = _access_token(svc, info)
        on_timeout: Literal["kill", "pause"] = (
            "pause" if info.on_timeout == OnTimeout.HIBERNATE else "kill"
        )
        fields["lifecycle"] = SandboxLifecycle(auto_resume=info.auto_resume, on_timeout=on_timeout)
    return shape(**fields)


def machine(svc: Services, tag: str) -> tuple[int, int]:
    """The vCPUs and MiB of guest memory of snapshot ``tag``'s machine ((1, 0) when the
    snapshot is gone since the sandbox was forked)."""
    row = svc.store.get_snapshot(tag)
    if row is None:
        return 1, 0
    try:
        machine = snapshot_files.load(Path(row.dir)).machine
    except SnapshotError:
        return 1, row.memory_mib
    return machine.vcpus, machine.memory_mib


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=UTC).isoformat(timespec="milliseconds")


@rest.post("/v2/sandboxes", status_code=201, response_model_by_alias=True)
async def create(body: NewSandbox, svc: Svc, domain: Domain) -> Sandbox:
    for name, why in UNSERVED.items():
        if getattr(body, name):
            raise Invalid(why)
    bad = [name for name in body.env_vars or {} if bad_env_name(name)]
    if bad:  # refused before anything is made
        raise Invalid(f"envVars: {bad[0]!r} is not a variable name")
    req = SandboxCreate(
        snapshot_tag=body.template_id,
        timeout_s=body.timeout or DEFAULT_TIMEOUT_S,
        on_timeout=OnTimeout.HIBERNATE if body.auto_pause else OnTimeout.KILL,
        auto_resume=body.auto_resume.enabled if body.auto_resume is not None else True,
        metadata=body.metadata or None,
        internet=body.allow_internet_access if body.network is None else None,
        network=None
        if body.network is None
        else policy_of(body.network, body.allow_internet_access),
    )
    mounts = [ShareMount(m.name, m.path) for m in body.volume_mounts or ()]
    [info] = await svc.sandboxes.create(req, mounts=mounts)
    if body.env_vars:
        await _with_env(svc, info.id, body.env_vars)
    return created(svc, info, domain)


async def _with_env(svc: Services, sandbox_id: str, env: dict[str, str]) -> None:
    """E2B's envVars, in the sandbox's own environment (every command started from now
    has them; its forks and branches too). A sandbox that cannot take them is killed."""
    try:
        await svc.guest.call(sandbox_id, lambda vm: vm.guest.env_set(env))
    except ForkdError:
        await svc.sandboxes.kill(sandbox_id)
        raise


@rest.get("/sandboxes/{sandbox_id}")
async def get(sandbox_id: str, svc: Svc) -> Response:
    info = alive(svc, sandbox_id)
    detail = _listed(svc, info, machine(svc, info.snapshot_tag), SandboxDetail)
    return _json(detail.model_dump(by_alias=True))


@rest.get("/v2/sandboxes")
async def list_(
    svc: Svc,
    state: Annotated[str | None, Query()] = None,
    metadata: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    wanted = _states(state)
    labels = _labels(metadata)
    found = [
        info
        for info in svc.sandboxes.list(metadata=labels or None)
        if info.state in _ALIVE and _e2b_state(info) in wanted
    ]
    found.sort(key=lambda i: (i.created_at_unix, i.id))
    page, headers = paged(found, lambda i: i.id, limit, next_token, "sandbox")
    machines = {tag: machine(svc, tag) for tag in {info.snapshot_tag for info in page}}
    body = [_listed(svc, i, machines[i.snapshot_tag]).model_dump(by_alias=True) for i in page]
    return _json(body, headers=headers)


def _states(text: str | None) -> set[str]:
    if text is None:
        return {"running", "paused"}
    words = {w for w in text.split(",") if w}
    unknown = words - {"running", "paused"}
    if unknown:
        raise Invalid(f"unknown state {sorted(unknown)[0]!r}: running or paused")
    return words


def _labels(text: str | None) -> dict[str, str]:
    """E2B's metadata filter: ``k=v&k2=v2`` in one query parameter."""
    if not text:
        return {}
    try:
        return dict(parse_qsl(text, keep_blank_values=True, strict_parsing=True))
    except ValueError:
        raise Invalid(f"metadata filter {text!r} is not k=v&k2=v2") from None


@rest.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, svc: Svc) -> None:
    alive(svc, sandbox_id)
    await svc.sandboxes.kill(sandbox_id)


@rest.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, svc: Svc) -> None:
    alive(svc, sandbox_id)
    svc.sandboxes.set_timeout(sandbox_id, TimeoutRequest(timeout_s=body.timeout or None))


@rest.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(sandbox_id: str, body: RefreshBody, svc: Svc) -> None:
    """E2B's keep-alive: the sandbox lives ``duration`` seconds from now (E2B's default
    60 s), never less than it had left; one without a lifetime keeps none."""
    info = alive(svc, sandbox_id)
    left = (info.expires_at_unix - time.time()) if info.expires_at_unix else None
    wanted = float(body.duration if body.duration is not None else 60)
    if left is not None and left < wanted:
        svc.sandboxes.set_timeout(sandbox_id, TimeoutRequest(timeout_s=wanted))


@rest.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, svc: Svc) -> None:
    info = alive(svc, sandbox_id)
    if info.state != SandboxState.RUNNING:
        raise Conflict(f"sandbox {sandbox_id!r} is already paused")
    await svc.pausing.pause(sandbox_id, hibernate=True)


@rest.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, svc: Svc) -> None:
    """E2B's runtime policy change: the sandbox's next connections are judged by it."""
    alive(svc, sandbox_id)
    given = body.model_extra or {}
    await svc.network.update(sandbox_id, policy_of(given, body.allow_internet_access))


@rest.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect(sandbox_id: str, body: ConnectBody, svc: Svc, domain: Domain) -> Response:
    info = alive(svc, sandbox_id)
    status = 200
    if info.state in (SandboxState.PAUSED, SandboxState.HIBERNATED):
        await svc.pausing.resume(sandbox_id, timeout_s=body.timeout)
        status = 201  # E2B answers a resumed sandbox with 201
    elif body.timeout is not None:
        svc.sandboxes.set_timeout(sandbox_id, TimeoutRequest(timeout_s=body.timeout))
    answer = created(svc, svc.sandboxes.info(sandbox_id), domain)
    return _json(answer.model_dump(by_alias=True), status=status)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status_code=status, headers=headers)
