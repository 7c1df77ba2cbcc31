"""Workspaces: the original forkd's named sandboxes."""

from __future__ import annotations

from fastapi import APIRouter, Response

from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models import (
    WorkspaceCreate,
    WorkspaceInfo,
    WorkspaceResume,
    WorkspaceSuspend,
)
from forkd.controller.routes.common import AnswerModel, Svc

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
