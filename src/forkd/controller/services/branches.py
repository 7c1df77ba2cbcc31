"""Branches: pause a running sandbox, snapshot it, resume it, register the snapshot.

The order and the failure table are :mod:`forkd.vmm.live_snapshot`'s; this
service adds what the daemon owns: the tag, the concurrency cap, one branch
of a sandbox at a time, and the registry.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from forkd.controller.models import BranchRequest, SnapshotInfo
from forkd.controller.services import hibernated_files
from forkd.controller.services.fleet import Fleet
from forkd.controller.services.snapshots import SnapshotService, snapshot_row
from forkd.controller.store import SandboxRow, merged_labels, now
from forkd.errors import Busy, Conflict, Invalid, SnapshotError, VMError
from forkd.limits import check_tag
from forkd.vmm import live_snapshot, snapshot_copy, snapshot_files
from forkd.vmm.snapshot_files import SnapshotLabels

MODES = (None, "full")


class BranchService:
    def __init__(self, fleet: Fleet, snapshots: SnapshotService) -> None:
        self.fleet = fleet
        self.snapshots = snapshots
        self.in_flight = 0

    async def branch(self, sandbox_id: str, req: BranchRequest) -> SnapshotInfo:
        if req.mode not in MODES:
            raise Invalid(f"branch mode {req.mode!r} is not supported (only 'full')")
        if req.tag is not None:
            check_tag(req.tag)
        fleet = self.fleet
        row = fleet.sandbox_row(sandbox_id)
        # A paused one is taken as it is; a hibernated one is its state on disk.
        vm = None if row.state == "hibernated" else fleet.live(sandbox_id, paused_ok=True)
        cap = fleet.settings.branch_concurrency
        if self.in_flight >= cap:
            raise Busy(f"{self.in_flight} branches are in flight (the cap is {cap}); retry shortly")
        tag = req.tag
        if tag is None:
            tag = check_tag(f"branch-{sandbox_id}-{fleet.store.next_branch_seq(sandbox_id)}")
        with fleet.reserve_tag(tag):
            self.in_flight += 1
            try:
                async with fleet.branch_locks.setdefault(sandbox_id, asyncio.Lock()):
                    labels = merged_labels(row.metadata, req.metadata)
                    if vm is None:
                        await self._branch_hibernated(row, tag, labels)
                    else:
                        await self._branch_locked(vm, row, tag, labels)
            finally:
                self.in_flight -= 1
        info = self.snapshots.info(tag)
        fleet.events.publish(
            "branched", sandbox_id=sandbox_id, snapshot_tag=tag, pause_ms=info.pause_ms
        )
        return info

    async def _branch_locked(
        self, vm: Any, row: SandboxRow, tag: str, metadata: dict[str, str]
    ) -> None:
        fleet = self.fleet
        if not vm.is_alive() or fleet.vms.get(row.id) is not vm:
            raise Conflict(f"sandbox {row.id!r} stopped running")
        # The source's volume settings carry over to the branch unchanged: the
        # VM records them (with the layer chain frozen at the pause).
        labels = SnapshotLabels(tag=tag, branched_from=row.id, parent_tag=row.snapshot_tag)
        dest = fleet.settings.snapshot_root / tag
        try:
            result = await live_snapshot.snapshot_running(vm, dest, labels)
        except live_snapshot.LiveSnapshotError as exc:
            if exc.snapshot_kept:
                self._register(tag, dest, metadata)
            paused = vm.state == "paused"  # its guest cannot answer: QEMU's life tells
            if not exc.source_alive or not (vm.is_alive() if paused else await fleet.answers(vm)):
                await fleet.mark_dead(row.id)
            if isinstance(exc.__cause__, Busy):  # the pause waited on the agent channel
                raise Busy(f"branch of {row.id}: {exc.__cause__}") from exc
            raise VMError(f"branch of {row.id} failed: {exc}") from exc
        fleet.store.add_snapshot(
            snapshot_row(
                tag, snapshot_files.SnapshotFiles(result.dir, result.meta), now(), metadata
            )
        )
        fleet.metrics.branch_pause_seconds.observe(result.pause_ms / 1000)

    async def _branch_hibernated(self, row: SandboxRow, tag: str, metadata: dict[str, str]) -> None:
        """The hibernated sandbox's state, copied: no VM, no pause (``pause_ms`` 0)."""
        fleet = self.fleet
        src = fleet.hibernated.latest(row.id)
        if fleet.sandbox_row(row.id).state != "hibernated" or src is None:
            raise Conflict(f"sandbox {row.id!r} is no longer hibernated; retry")
        labels = SnapshotLabels(
            tag=tag, branched_from=row.id, parent_tag=row.snapshot_tag, pause_ms=0.0
        )
        dest = fleet.settings.snapshot_root / tag
        files = await asyncio.to_thread(
            snapshot_copy.copy_snapshot, src, dest, labels, (hibernated_files.NETWORK_FILE,)
        )
        fleet.store.add_snapshot(snapshot_row(tag, files, now(), metadata))
        fleet.metrics.branch_pause_seconds.observe(0.0)

    def _register(self, tag: str, snapshot_dir: Path, metadata: dict[str, str]) -> None:
        """Register a snapshot the driver kept although the branch failed."""
        try:
            files = snapshot_files.load(snapshot_dir)
        except SnapshotError:
            return
        self.fleet.store.add_snapshot(snapshot_row(tag, files, now(), metadata))
