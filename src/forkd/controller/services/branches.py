"""Branches: pause a running sandbox, snapshot it, resume it, register the snapshot.

The order and the failure table are :mod:`forkd.vmm.snapshot.live`'s; this
service adds what the daemon owns: the tag, the mode, the concurrency cap, one
branch of a sandbox at a time, the registry, and branches that finish in the
background (``wait: false``: registered ``writing`` at once, then ``ready`` or
``failed`` with the error, the failure table's other columns unchanged).

Modes: ``full`` copies the whole memory; ``diff`` stores only the pages that
differ from the snapshot the source was forked from (its base, a dependency);
``live`` would copy while the source runs, which needs dirty-page tracking
this host lacks, so it is taken as ``full`` (and recorded as such).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from forkd import limits, tracing
from forkd.controller.metrics import Metrics
from forkd.controller.models import BranchRequest, SnapshotInfo
from forkd.controller.services import hibernated_files
from forkd.controller.services.disk_room import require_room
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.holds import Holds
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.shared_volumes import SharedVolumes
from forkd.controller.services.snapshots import SnapshotService, memory_file, snapshot_row
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow, merged_labels, now
from forkd.errors import Busy, Conflict, ForkdError, Invalid, SnapshotError, VMError
from forkd.limits import check_tag
from forkd.states import BranchMode, SandboxState, SnapshotMode, SnapshotStatus, VMState
from forkd.vmm.snapshot import copy as snapshot_copy
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import live as live_snapshot
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import BaseRef, SnapshotLabels

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One branch being made: what it takes, where it goes, and how."""

    lock: asyncio.Lock  # the source's: one branch of a sandbox at a time
    vm: SandboxVM | None  # the source's VM; None: it is hibernated
    row: SandboxRow  # the source's record
    tag: str
    labels: dict[str, str]
    base: BaseRef | None  # a diff's base; None: full
    live: bool


class BranchService:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        events: EventBus,
        holds: Holds,
        hibernated: HibernatedFiles,
        records: Records,
        vms: LiveVMs,
        snapshots: SnapshotService,
        shared: SharedVolumes,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.events = events
        self.holds = holds
        self.hibernated = hibernated
        self.records = records
        self.vms = vms
        self.snapshots = snapshots
        self.shared = shared  # E2B's volumes: a branch's forks mount its source's
        self.in_flight = 0
        self.background: set[asyncio.Task[None]] = set()  # branches with wait false

    async def branch(
        self, sandbox_id: str, req: BranchRequest, drop_labels: Collection[str] = ()
    ) -> SnapshotInfo:
        """``drop_labels``: labels of the source the branch does not take (an explore's
        marks of the search the source was itself a variant of). The branch takes the
        source's stop hook, and its forks then do."""
        with tracing.span("branch", sandbox_id=sandbox_id, tag=req.tag):
            info = await self._branch(sandbox_id, req, drop_labels)
        if self.vms.hooks is not None:
            self.vms.hooks.for_branch(sandbox_id, info.tag)
        return info

    async def _branch(
        self, sandbox_id: str, req: BranchRequest, drop_labels: Collection[str]
    ) -> SnapshotInfo:
        mode = requested_mode(req)
        row, vm = self._source(sandbox_id, req)
        measure = req.measure_diff
        base = self._diff_base(row, vm) if mode == BranchMode.DIFF or measure else None
        cap = self.settings.branch_concurrency
        if self.in_flight >= cap:
            raise Busy(f"{self.in_flight} branches are in flight (the cap is {cap}); retry shortly")
        tag = req.tag
        if tag is None:
            tag = check_tag(f"branch-{sandbox_id}-{self.store.next_branch_seq(sandbox_id)}")
        inherited = {k: v for k, v in row.metadata.items() if k not in drop_labels}
        labels = merged_labels(inherited, req.metadata)
        with contextlib.ExitStack() as held:
            held.enter_context(self.records.reserve_tag(tag))
            held.enter_context(self._counted(base))
            # The lock is taken now and held: an entry dropped meanwhile must not let a
            # second run.
            lock = self.holds.sandbox_lock(row.id)
            plan = _Plan(lock, vm, row, tag, labels, base, mode == BranchMode.LIVE)
            if measure and base is not None:  # a full branch, then what a diff would store
                await self._run(dataclasses.replace(plan, base=None))
                info = self._branched(row.id, tag)
                taken = self.records.snapshot_row(tag)  # its files, where the answer may not say
                return _with(info, await asyncio.to_thread(_measured_diff, tag, taken, base))
            if req.wait:
                await self._run(plan)
                info = self._branched(row.id, tag)
                if base is None:
                    return info
                return _with(info, _diff_figures(self.records.snapshot_row(tag)))
            self.store.add_snapshot(self._pending_row(plan))
            settled = self._in_background(held.pop_all(), plan)
        # As the original answered: once the source runs again, with its pause_ms; the
        # files are written in the background (or it already failed, or finished).
        await asyncio.wait(settled, return_when=asyncio.FIRST_COMPLETED)
        return self.snapshots.info(tag)

    def _source(self, sandbox_id: str, req: BranchRequest) -> tuple[SandboxRow, SandboxVM | None]:
        """The sandbox a branch is of, its VM (None: hibernated, its state on disk), once
        the request is checked against it and the disk has room."""
        if req.tag is not None:
            check_tag(req.tag)
        row = self.records.sandbox_row(sandbox_id)
        if req.parent_tag is not None and req.parent_tag != row.snapshot_tag:
            raise Invalid(
                f"parent_tag {req.parent_tag!r} is not the snapshot sandbox {row.id!r} was "
                f"forked from ({row.snapshot_tag!r}): a diff is over that one"
            )
        # A paused one is taken as it is; a hibernated one is its state on disk.
        vm = (
            None
            if row.state == SandboxState.HIBERNATED
            else self.vms.live(sandbox_id, paused_ok=True)
        )
        reserve = self.settings.disk_reserve_mib
        require_room(self.settings.snapshot_root, reserve, f"branching {sandbox_id}")
        return row, vm

    def _in_background(self, held: contextlib.ExitStack, plan: _Plan) -> set[asyncio.Future[Any]]:
        """Run the branch (``wait`` false) as a task that holds ``held`` until it ends;
        returns the task and a future set once the source runs again."""
        resumed: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        def on_resumed(pause_ms: float) -> None:  # the answer waits for the pause only
            self.store.update_snapshot(plan.tag, pause_ms=pause_ms)
            if not resumed.done():
                resumed.set_result(pause_ms)

        task = asyncio.create_task(self._settle(held, plan, on_resumed), name=f"branch-{plan.tag}")
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return {resumed, task}

    def _diff_base(self, row: SandboxRow, vm: SandboxVM | None) -> BaseRef:
        """The snapshot a diff of this sandbox is over: the registered one its memory maps,
        the same snapshot (its id), not only one of the same tag. A hibernated sandbox's
        whole memory is on disk: its diff is over whatever its snapshot's tag holds."""
        brow = self.store.get_snapshot(row.snapshot_tag)
        if brow is not None and self.holds.is_deleting(brow.tag):
            raise Conflict(f"snapshot {brow.tag!r} is being deleted: branch with mode full")
        files = _loaded(brow) if brow is not None and brow.status == SnapshotStatus.READY else None
        mapped = files is not None and (
            vm is None
            or (
                vm.origin is not None
                and files.meta.id == vm.origin_id
                and os.path.realpath(vm.origin) == os.path.realpath(files.dir)
            )
        )
        if brow is None or files is None or not mapped:
            raise Conflict(
                f"sandbox {row.id!r} has no registered snapshot to be a diff over (its snapshot "
                f"{row.snapshot_tag!r} was deleted, replaced, or it was resumed from "
                "hibernation): branch it with mode full"
            )
        depth = self.snapshots.diff_depth(brow) + 1
        if depth > limits.MAX_DIFF_DEPTH:
            raise Conflict(
                f"a diff over {brow.tag!r} would be {depth} levels deep, over the cap of "
                f"{limits.MAX_DIFF_DEPTH}: compact {brow.tag!r} first, or branch with mode full"
            )
        return BaseRef(brow.tag, brow.dir, files.meta.id)

    @contextlib.contextmanager
    def _counted(self, base: BaseRef | None) -> Iterator[None]:
        """In flight (the cap) and, for a diff, its base held against deletion."""
        self.in_flight += 1
        try:
            with self.holds.diff_base(base.tag if base is not None else None):
                yield
        finally:
            self.in_flight -= 1

    async def _run(self, plan: _Plan, on_resumed: Callable[[float], None] | None = None) -> None:
        async with plan.lock:
            if plan.vm is None:
                if on_resumed is not None:
                    on_resumed(0.0)  # nothing runs: no pause
                await self._branch_hibernated(plan)
            else:
                await self._branch_locked(plan, plan.vm, on_resumed)

    def _branched(self, sandbox_id: str, tag: str) -> SnapshotInfo:
        """The branch's answer (its ``branched`` event went out as it became ready)."""
        return self.snapshots.info(tag)

    def _ready(
        self, sandbox_id: str, tag: str, files: snapshot_files.SnapshotFiles, labels: dict[str, str]
    ) -> None:
        """The branch is registered ready, counted, and its ``branched`` event (and the
        webhooks' outbox rows of it) written, in one transaction."""
        made = now()
        with self.store.transaction():
            self.store.add_snapshot(snapshot_row(tag, files, made, labels), replace=True)
            self.shared.record_branch(tag, made, sandbox_id)
            self.store.count_branch(sandbox_id)
            pause = files.meta.pause_ms
            pause_ms = None if pause is None else round(pause)  # as SnapshotInfo has it
            self.events.publish(
                "branched", sandbox_id=sandbox_id, snapshot_tag=tag, pause_ms=pause_ms
            )

    def _pending_row(self, plan: _Plan) -> SnapshotRow:
        vm, row, tag, labels, base = plan.vm, plan.row, plan.tag, plan.labels, plan.base
        parent = self.store.get_snapshot(row.snapshot_tag)
        memory_mib = vm.machine.memory_mib if vm is not None else parent.memory_mib if parent else 0
        return SnapshotRow(
            tag=tag,
            dir=str(self.settings.snapshot_root / tag),
            created_at_unix=now(),
            branched_from=row.id,
            pause_ms=None,
            parent_tag=row.snapshot_tag,
            image=parent.image if parent else None,
            memory_mib=memory_mib,
            status=SnapshotStatus.WRITING,
            metadata=labels,
            mode=SnapshotMode.DIFF if base else SnapshotMode.FULL,
            base_tag=base.tag if base else None,
        )

    async def _settle(
        self, held: contextlib.ExitStack, plan: _Plan, on_resumed: Callable[[float], None]
    ) -> None:
        """A branch with wait false: ``writing`` → ``ready``, or ``failed`` with the error."""
        store, row, tag = self.store, plan.row, plan.tag
        with held:
            try:
                await self._run(plan, on_resumed)
            except Exception as exc:  # the error is the answer: kept in the registry
                kept = store.get_snapshot(tag)
                if (
                    kept is not None and kept.status == SnapshotStatus.READY
                ):  # resume failed after a good one
                    store.update_snapshot(tag, error=str(exc))
                elif kept is not None:
                    store.set_snapshot_status(tag, SnapshotStatus.FAILED, error=str(exc))
                log.warning("branch %s of %s failed in the background: %s", tag, row.id, exc)

    async def _branch_locked(
        self, plan: _Plan, vm: SandboxVM, on_resumed: Callable[[float], None] | None
    ) -> None:
        row, tag, metadata, base = plan.row, plan.tag, plan.labels, plan.base
        if not vm.is_alive() or self.vms.get(row.id) is not vm:
            raise Conflict(f"sandbox {row.id!r} stopped running")
        # The source's volume settings carry over to the branch unchanged: the
        # VM records them (with the layer chain frozen at the pause).
        labels = SnapshotLabels(tag=tag, branched_from=row.id, parent_tag=row.snapshot_tag)
        dest = self.settings.snapshot_root / tag
        try:
            result = await live_snapshot.snapshot_running(
                vm, dest, labels, base, live=plan.live, on_resumed=on_resumed
            )
        except live_snapshot.LiveSnapshotError as exc:
            if exc.snapshot_kept:
                self._register(tag, dest, metadata)
            paused = vm.state == VMState.PAUSED  # its guest cannot answer: QEMU's life tells
            if not exc.source_alive or not (
                vm.is_alive() if paused else await self.vms.answers(vm)
            ):
                await self.vms.mark_dead(row.id)
            if isinstance(exc.reason, Busy):  # the pause waited on the agent channel
                raise Busy(f"branch of {row.id}: {exc.reason}") from exc
            raise VMError(f"branch of {row.id} failed: {exc}") from exc
        files = snapshot_files.SnapshotFiles(result.dir, result.meta)
        self._ready(row.id, tag, files, metadata)
        self.metrics.branch_pause_seconds.observe(result.pause_ms / 1000)

    async def _branch_hibernated(self, plan: _Plan) -> None:
        """The hibernated sandbox's state, copied (or diffed over its base): no VM, no
        pause (``pause_ms`` 0)."""
        row, tag, metadata, base = plan.row, plan.tag, plan.labels, plan.base
        src = self.hibernated.latest(row.id)
        if self.records.sandbox_row(row.id).state != SandboxState.HIBERNATED or src is None:
            raise Conflict(f"sandbox {row.id!r} is no longer hibernated; retry")
        labels = SnapshotLabels(
            tag=tag, branched_from=row.id, parent_tag=row.snapshot_tag, pause_ms=0.0
        )
        dest = self.settings.snapshot_root / tag
        try:
            with self.holds.reading_hibernated(row.id):  # not discarded under the copy
                files = await asyncio.to_thread(
                    snapshot_copy.copy_snapshot,
                    src,
                    dest,
                    labels,
                    (hibernated_files.NETWORK_FILE,),
                    base,
                )
        except ForkdError:
            raise
        except OSError as exc:
            raise SnapshotError(f"branch of {row.id} failed: {exc}") from exc
        self._ready(row.id, tag, files, metadata)
        self.metrics.branch_pause_seconds.observe(0.0)

    def _register(self, tag: str, snapshot_dir: Path, metadata: dict[str, str]) -> None:
        """Register a snapshot the driver kept although the branch failed."""
        try:
            files = snapshot_files.load(snapshot_dir)
        except SnapshotError:
            return
        self.store.add_snapshot(snapshot_row(tag, files, now(), metadata), replace=True)


def requested_mode(req: BranchRequest) -> BranchMode | None:
    """The mode a branch request asks for: ``mode``, or the original forkd's ``diff`` and
    ``live`` booleans, checked as the original checked them (400s)."""
    if req.mode is not None and req.mode not in tuple(BranchMode):
        raise Invalid(f"branch mode {req.mode!r} is not supported (full, diff or live)")
    legacy = [BranchMode(name) for name in ("diff", "live") if getattr(req, name)]
    if req.mode is not None and legacy:
        raise Invalid(
            f"set either mode or the older {' and '.join(legacy)}: true, not both "
            f"(mode {req.mode!r})"
        )
    if len(legacy) > 1:
        raise Invalid("set at most one of diff and live")
    mode = BranchMode(req.mode) if req.mode else (legacy[0] if legacy else None)
    if req.measure_diff and mode in (BranchMode.DIFF, BranchMode.LIVE):
        raise Invalid(
            f"measure_diff reports what a diff would store beside a full branch: "
            f"not with mode {mode.value!r}"
        )
    if req.parent_tag is not None and mode != BranchMode.DIFF:
        raise Invalid("parent_tag names a diff's base: it needs mode diff (or diff: true)")
    # The original's forms keep the original's rule: only a live branch may answer early.
    if not req.wait and mode != BranchMode.LIVE and (legacy or req.measure_diff):
        raise Invalid(
            "wait: false needs mode live (or live: true) in this form of the request; "
            "or send mode full/diff with wait false"
        )
    return mode


def _with(info: SnapshotInfo, extra: dict[str, int]) -> SnapshotInfo:
    """``info`` with fields added (and so sent: answers leave out what was never set)."""
    return info.model_copy(update=extra)


def _diff_figures(row: SnapshotRow) -> dict[str, int]:
    """A diff branch's figures, as the original forkd reported them: the capture's time
    inside the pause, the bytes its pages take on disk, and the RAM they cover."""
    files = snapshot_files.load(Path(row.dir))
    data = memory_file(row)
    return {
        "diff_ms": round(files.meta.capture_ms),
        "diff_physical_bytes": data.stat().st_blocks * 512,
        "diff_logical_bytes": files.meta.memory_bytes,
    }


def _measured_diff(tag: str, row: SnapshotRow, base: BaseRef) -> dict[str, int]:
    """What a diff over ``base`` would have stored for the full branch ``tag``: its pages
    that differ from the base's, counted after the source runs again."""
    files = snapshot_files.load(Path(row.dir))
    started = time.monotonic()
    try:
        base_files = snapshot_files.load(Path(base.dir))
        with memory_diff.resolve(base_files) as chain:
            pages = memory_diff.count_differing(memory_file(row), chain)
    except (OSError, SnapshotError) as exc:
        raise SnapshotError(
            f"branch {tag} was taken, but measuring its diff failed: {exc}"
        ) from exc
    return {
        "diff_ms": round((time.monotonic() - started) * 1000),
        "diff_physical_bytes": pages * memory_diff.PAGE,
        "diff_logical_bytes": files.meta.memory_bytes,
    }


def _loaded(row: SnapshotRow) -> snapshot_files.SnapshotFiles | None:
    """The snapshot's files and record; ``None`` when they are unreadable."""
    try:
        return snapshot_files.load(Path(row.dir))
    except SnapshotError:
        return None
