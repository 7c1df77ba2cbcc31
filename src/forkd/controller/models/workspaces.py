"""Workspaces: a named sandbox suspended and resumed across daemon restarts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from forkd import limits
from forkd.controller.models.common import TAG, StrictBody, original_field


class WorkspaceCreate(StrictBody):
    name: str = Field(pattern=limits.NAME_PATTERN, description="the workspace's name, as a tag")
    snapshot_tag: str = TAG
    per_child_netns: bool = False
    memory_limit_mib: int | None = Field(
        None, ge=limits.MIN_MEMORY_LIMIT_MIB, le=limits.MAX_MEMORY_MIB
    )


class WorkspaceSuspend(StrictBody):
    diff: bool = original_field(False, "a suspend writes the sandbox's whole state (hibernation)")


class WorkspaceResume(StrictBody):
    pass


# A workspace: its sandbox runs (or is paused), is hibernated, or is gone.
WorkspaceStatus = Literal["running", "suspended", "stale"]


class WorkspaceInfo(BaseModel):
    """A workspace (the original forkd's): a named sandbox that is suspended to disk and
    resumed, its state kept in between. Fields that do not apply are left out."""

    id: str
    name: str
    source_snapshot_tag: str
    status: WorkspaceStatus = Field(
        description="running (also while paused); suspended: hibernated to disk; stale: "
        "its sandbox is gone (resume forks a new one from source_snapshot_tag)"
    )
    live_sandbox_id: str | None = Field(None, description="running only: its sandbox")
    sandbox_id: str | None = Field(
        None, description="the sandbox holding its state, running or hibernated (ours)"
    )
    current_state_tag: str | None = Field(
        None,
        description="the original's state snapshot: none here, the state is the "
        "hibernated sandbox itself",
    )
    created_at_unix: int
    last_active_unix: int
