"""Workspaces (the original forkd's ``/v1/workspaces``): a named sandbox that is suspended
and resumed, its state kept in between.

A workspace is one sandbox forked from a snapshot. Suspending it hibernates that
sandbox (its whole state written to disk, its QEMU ended, its memory given back);
resuming wakes the same sandbox, with the same id, processes and files. The status
is read from the sandbox each time: running (or paused), suspended (hibernated), or
stale when the sandbox is gone (killed, or its files lost); a stale workspace's
resume forks a new sandbox from the source snapshot with the options it was made
with. The registry row survives daemon restarts, as the sandboxes do.
"""

from __future__ import annotations

import builtins
import contextlib

from forkd import limits
from forkd.controller.models import SandboxCreate, WorkspaceCreate, WorkspaceInfo, WorkspaceStatus
from forkd.controller.services.pausing import PauseService
from forkd.controller.services.sandboxes import SandboxService
from forkd.controller.store import Store
from forkd.controller.store_rows import WorkspaceRow, now
from forkd.errors import Conflict, Invalid, NotFound
from forkd.states import SandboxState

WORKSPACE_LABEL = "workspace"  # on its sandbox: the workspace's name


class WorkspaceService:
    def __init__(
        self,
        store: Store,
        sandboxes: SandboxService,
        pausing: PauseService,
    ) -> None:
        self.store = store
        self.sandboxes = sandboxes
        self.pausing = pausing
        self._creating: set[str] = set()

    def list(self) -> builtins.list[WorkspaceInfo]:
        return [self._info(row) for row in self.store.list_workspaces()]

    def info(self, name: str) -> WorkspaceInfo:
        return self._info(self._row(name))

    async def create(self, req: WorkspaceCreate) -> WorkspaceInfo:
        name = limits.check_tag(req.name)
        store = self.store
        if name in self._creating or store.get_workspace(name) is not None:
            raise Conflict(f"workspace {name!r} already exists; DELETE it first")
        self._creating.add(name)
        try:
            sandbox_id = await self._fork(
                name, req.snapshot_tag, req.per_child_netns, req.memory_limit_mib
            )
            t = now()
            store.add_workspace(
                WorkspaceRow(
                    name=name,
                    id=f"ws-{sandbox_id}",
                    source_snapshot_tag=req.snapshot_tag,
                    sandbox_id=sandbox_id,
                    created_at_unix=t,
                    last_active_unix=t,
                    per_child_netns=req.per_child_netns,
                    memory_limit_mib=req.memory_limit_mib,
                )
            )
        finally:
            self._creating.discard(name)
        return self.info(name)

    async def delete(self, name: str) -> None:
        """Kill its sandbox (whatever its state) and forget it; the source snapshot stays."""
        row = self._row(name)
        if self._status(row) != "stale":
            assert row.sandbox_id is not None
            with contextlib.suppress(NotFound):  # gone meanwhile
                await self.sandboxes.kill(row.sandbox_id)
        self.store.delete_workspace(name)

    async def suspend(self, name: str) -> WorkspaceInfo:
        row = self._row(name)
        status = self._status(row)
        if status != "running":
            raise Invalid(f"workspace {name!r} is {status}, not running: suspend needs its sandbox")
        assert row.sandbox_id is not None
        await self.pausing.pause(row.sandbox_id, hibernate=True)
        self.store.update_workspace(name, last_active_unix=now())
        return self.info(name)

    async def resume(self, name: str) -> WorkspaceInfo:
        row = self._row(name)
        status = self._status(row)
        if status == "running":
            raise Invalid(f"workspace {name!r} is already running")
        if status == "suspended":
            assert row.sandbox_id is not None
            await self.pausing.resume(row.sandbox_id)
            self.store.update_workspace(name, last_active_unix=now())
        else:  # stale: a new sandbox of its source, made as the first was
            sandbox_id = await self._fork(
                name, row.source_snapshot_tag, row.per_child_netns, row.memory_limit_mib
            )
            self.store.update_workspace(name, sandbox_id=sandbox_id, last_active_unix=now())
        return self.info(name)

    async def _fork(
        self, name: str, tag: str, per_child_netns: bool, memory_limit_mib: int | None
    ) -> str:
        req = SandboxCreate(
            snapshot_tag=tag,
            n=1,
            per_child_netns=per_child_netns,
            memory_limit_mib=memory_limit_mib,
            metadata={WORKSPACE_LABEL: name},
        )
        (made,) = await self.sandboxes.create(req)
        return made.id

    def _row(self, name: str) -> WorkspaceRow:
        row = self.store.get_workspace(name)
        if row is None:
            raise NotFound(f"workspace {name!r} not found")
        return row

    def _status(self, row: WorkspaceRow) -> WorkspaceStatus:
        sandbox = self.store.get_sandbox(row.sandbox_id) if row.sandbox_id else None
        if sandbox is None or sandbox.state == SandboxState.DEAD:
            return "stale"
        return "suspended" if sandbox.state == SandboxState.HIBERNATED else "running"

    def _info(self, row: WorkspaceRow) -> WorkspaceInfo:
        status = self._status(row)
        return WorkspaceInfo(
            id=row.id,
            name=row.name,
            source_snapshot_tag=row.source_snapshot_tag,
            status=status,
            live_sandbox_id=row.sandbox_id if status == "running" else None,
            sandbox_id=row.sandbox_id if status != "stale" else None,
            created_at_unix=row.created_at_unix,
            last_active_unix=row.last_active_unix,
        )
