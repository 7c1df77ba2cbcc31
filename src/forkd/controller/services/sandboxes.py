"""Sandboxes: fork them from snapshots, describe, update and kill them (their guests are
reached through :mod:`.guest_calls`)."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar, overload

from forkd import limits, tracing
from forkd.controller.metrics import Metrics
from forkd.controller.models import (
    SANDBOX_STATES,
    SandboxCreate,
    SandboxInfo,
    SandboxUpdate,
    TimeoutRequest,
)
from forkd.controller.services.activity import Activity
from forkd.controller.services.admission import Admission, AdmissionControl
from forkd.controller.services.events import EventBus
from forkd.controller.services.holds import Holds
from forkd.controller.services.launcher import Launcher
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.shared_volumes import SharedVolumes, ShareMount
from forkd.controller.services.snapshots import SnapshotService, memory_file
from forkd.controller.services.stop_hooks import StopHook
from forkd.controller.services.waking import Waker
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import (
    SandboxChanges,
    SandboxRow,
    SnapshotRow,
    labelled,
    merged_labels,
    now,
)
from forkd.errors import (
    Busy,
    Conflict,
    Invalid,
    NotFound,
    Unavailable,
    VMError,
)
from forkd.states import SandboxState, SnapshotStatus, VMState
from forkd.vmm.jail import cgroups, egress
from forkd.vmm.jail.egress import Egress
from forkd.vmm.pool import ForkPool
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.volumes.shares import Share
from forkd.vmm.volumes.shares import mount as mount_shares

T = TypeVar("T")


FORK_PARALLELISM = 4  # restores in flight at once (each is a QEMU start)

# Failures a fork passes on as they are; any other one is "forking failed" (500).
_CALLERS_FAULT = (Invalid, NotFound, Conflict, Busy, Unavailable)


@dataclass(frozen=True)
class _Forking:
    """One create's forks: what each of them is made from and given."""

    req: SandboxCreate
    tag: str
    snap_dir: Path
    policy: Egress | None
    shares: list[Share]


def _lifetime(req: SandboxCreate) -> float | None:
    """The fork's timeout in seconds (``timeout_s``, or its older name ``timeout_secs``)."""
    given = {t for t in (req.timeout_s, req.timeout_secs) if t is not None}
    if len(given) > 1:
        raise Invalid("timeout_s and timeout_secs differ: give one")
    return given.pop() if given else None


def expiry_in(timeout_s: float | None) -> float | None:
    """The time ``timeout_s`` seconds from now (None: no timeout)."""
    return time.time() + timeout_s if timeout_s is not None else None


@overload
def iso_time(unix: float) -> str: ...
@overload
def iso_time(unix: float | None) -> str | None: ...
def iso_time(unix: float | None) -> str | None:
    """``unix`` as ISO 8601 UTC to the millisecond (None: None)."""
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, tz=UTC).isoformat(timespec="milliseconds")


class SandboxService:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        events: EventBus,
        holds: Holds,
        activity: Activity,
        records: Records,
        vms: LiveVMs,
        pool: ForkPool[SandboxVM],
        launcher: Launcher,
        admission: AdmissionControl,
        waker: Waker,
        snapshots: SnapshotService,
        shared: SharedVolumes,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.events = events
        self.holds = holds
        self.activity = activity
        self.records = records
        self.vms = vms
        self.pool = pool
        self.launcher = launcher
        self.admission = admission
        self.waker = waker
        self.snapshots = snapshots
        self.shared = shared  # E2B's volumes: mounted at create, or a branch's own
        self._fork_slots = asyncio.Semaphore(FORK_PARALLELISM)

    # ------------------------------------------------------------ fork

    async def create(
        self, req: SandboxCreate, pool: bool = True, mounts: Sequence[ShareMount] = ()
    ) -> list[SandboxInfo]:
        """Fork ``req.n`` sandboxes from a snapshot: all of them, or none. ``pool``
        False: a one-off fork (an explore's, a diff's) that neither takes from the warm
        pool nor teaches it the snapshot's demand. ``mounts``: shared volumes each
        mounts (else the snapshot's own, a branch of a sandbox that mounted some)."""
        tag = limits.check_tag(req.snapshot_tag)
        row = self.records.snapshot_row(tag)
        shares = self._shares_for(row, mounts)
        problem = self.snapshots.unbootable_reason(row)
        if problem is not None:
            raise Conflict(f"snapshot {tag!r} is not bootable: {problem}")
        if req.per_child_netns and not self.launcher.network.enabled:
            raise Unavailable(
                f"per_child_netns needs network namespaces: {self.launcher.network.reason}"
            )
        _lifetime(req)  # refused here, before anything is made
        if req.seed is not None and req.seed + req.n - 1 > limits.MAX_SEED:
            raise Invalid(f"seed {req.seed} + n {req.n} - 1 is over {limits.MAX_SEED}")
        policy = egress.requested(req.egress, req.internet, req.network)
        snap_dir = Path(row.dir)
        machine = snapshot_files.load(snap_dir).machine
        if req.memory_limit_mib is not None and self.launcher.cgroups.limits_memory:
            cgroups.check_memory_limit(req.memory_limit_mib, machine.memory_mib, machine.accel)
        what = f"forking {req.n} from {tag!r}"
        with tracing.span("fork", snapshot_tag=tag, count=req.n):
            self.admission.check_caps(what, req.n, machine.memory_mib)  # before any eviction
            await self.admission.make_room_for(req.n, snap_dir)
            with self.admission.admit(what, req.n, machine.memory_mib, origin=snap_dir) as held:
                # A pooled QEMU's share slots are empty: forks with shares start their own.
                forking = _Forking(req, tag, snap_dir, policy, shares)
                made = await self._fork_all(forking, held, pool and not shares)
        if self.vms.hooks is not None:  # the request's stop hook, else the template's
            given = StopHook(req.on_stop, req.on_stop_timeout_s) if req.on_stop else None
            self.vms.hooks.for_children([info.id for info in made], tag, given)
        return made

    def _shares_for(self, row: SnapshotRow, mounts: Sequence[ShareMount]) -> list[Share]:
        if mounts:
            return self.shared.shares_for(mounts)
        return self.shared.of_snapshot(row.tag, row.created_at_unix)

    async def _fork_all(self, f: _Forking, held: Admission, pool: bool) -> list[SandboxInfo]:
        req, tag, snap_dir, policy = f.req, f.tag, f.snap_dir, f.policy
        pooled: list[SandboxVM] = []
        # Pooled QEMUs were started with the snapshot's policy and the default limit.
        if pool and policy is None and req.memory_limit_mib is None:
            self.pool.record_demand(snap_dir, req.n)
            while len(pooled) < req.n and (vm := self.pool.take(snap_dir)) is not None:
                pooled.append(vm)
        ids = [vm.id for vm in pooled]
        ids += [self.store.next_sandbox_id() for _ in range(req.n - len(pooled))]
        held.ids.update(ids)
        waiting = {vm.id: vm for vm in pooled}
        with self.holds.volume_layers():
            seeds = [None if req.seed is None else req.seed + i for i in range(len(ids))]
            results = await asyncio.gather(
                *(
                    self._fork_one(sid, f, waiting, seed)
                    for sid, seed in zip(ids, seeds, strict=True)
                ),
                return_exceptions=True,
            )
        if pool and self.store.get_snapshot(tag) is not None:  # not deleted meanwhile
            self.pool.refill(snap_dir)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self._undo(ids, waiting)
            first = failures[0]
            if isinstance(first, _CALLERS_FAULT):
                raise first
            raise VMError(
                f"forking {req.n} from {tag!r} failed, none were kept: {first}"
            ) from first
        facts = self._branch_facts()  # once for all of them: it reads every snapshot
        return [self._info(self.records.sandbox_row(sid), facts) for sid in ids]

    async def _fork_one(
        self, sid: str, f: _Forking, waiting: dict[str, SandboxVM], seed: int | None
    ) -> None:
        req = f.req
        run_dir = self.settings.run_dir / sid
        self.store.add_sandbox(
            SandboxRow(
                id=sid,
                snapshot_tag=req.snapshot_tag,
                run_dir=str(run_dir),
                pid=None,
                created_at_unix=now(),
                memory_limit_mib=req.memory_limit_mib,
                expires_at_unix=expiry_in(_lifetime(req)),
                state=SandboxState.STARTING,
                on_timeout=req.on_timeout,
                idle_timeout_s=req.idle_timeout_s,
                seed=seed,
                auto_resume=req.auto_resume,
                evictable=req.evictable,
                metadata=merged_labels(
                    self.records.snapshot_row(req.snapshot_tag).metadata, req.metadata
                ),
            )
        )
        if f.shares:  # recorded before its QEMU starts: see shared_volumes
            self.shared.attach(sid, f.shares)
        async with self._fork_slots:
            with tracing.span("restore", sandbox_id=sid):
                vm = waiting.pop(sid, None)
                if vm is not None and vm.state == VMState.WARM:
                    await vm.claim(seed=seed)  # restored ahead of time: cont, a fresh identity
                elif vm is not None:
                    await vm.finish_restore(seed=seed)
                else:
                    vm = await self.launcher.driver.restore(
                        f.snap_dir,
                        run_root=self.settings.run_dir,
                        vm_id=sid,
                        detach=True,
                        host_network=self.launcher.network,
                        egress_policy=f.policy,
                        cgroup=self.launcher.placement(req.memory_limit_mib),
                        seed=seed,
                        shares=f.shares,
                    )
        self.vms[sid] = vm
        await mount_shares(vm.guest.exec, f.shares)
        fork_ms = round(vm.ready_ms or 0, 1)
        with self.store.transaction():  # the event's outbox rows with the state change
            self.store.set_sandbox_state(sid, SandboxState.RUNNING, pid=vm.pid, fork_ms=fork_ms)
            self.events.publish(
                "created", sandbox_id=sid, snapshot_tag=req.snapshot_tag, fork_ms=fork_ms
            )
        self.metrics.fork_seconds.observe((vm.ready_ms or 0) / 1000)

    async def _undo(self, ids: list[str], waiting: dict[str, SandboxVM]) -> None:
        for vm in waiting.values():
            await vm.kill()
        removed = await asyncio.gather(
            *(self.vms.remove(sid, "fork_failed") for sid in ids), return_exceptions=True
        )
        for sid, result in zip(ids, removed, strict=True):
            if isinstance(result, BaseException):  # its remove stopped before its row
                self.store.delete_sandbox(sid)

    # ------------------------------------------------------------ read, kill

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self._info(self.records.sandbox_row(sandbox_id), self._branch_facts())

    def _branch_facts(self) -> tuple[dict[str, int], dict[str, str]]:
        """Per sandbox: how many branches it took, and the memory file of its latest one
        still registered (the original forkd's ``last_branch_memory_path``)."""
        latest: dict[str, SnapshotRow] = {}
        for snap in self.store.list_snapshots():
            source = snap.branched_from
            if source is None or snap.status != SnapshotStatus.READY:
                continue
            if source not in latest or snap.created_at_unix >= latest[source].created_at_unix:
                latest[source] = snap
        shown = self.settings.shown_path
        paths = {source: shown(memory_file(snap)) for source, snap in latest.items()}
        return self.store.branch_counts(), paths

    def _info(self, row: SandboxRow, facts: tuple[dict[str, int], dict[str, str]]) -> SandboxInfo:
        sandbox_id = row.id
        vm = self.vms.get(sandbox_id)
        net = vm.net if vm is not None else None
        branch_counts, last_branch = facts
        branches = branch_counts.get(sandbox_id, 0)
        return SandboxInfo(
            id=row.id,
            snapshot_tag=row.snapshot_tag,
            netns=net.netns if net else None,
            guest_addr=net.guest_addr if net else None,
            created_at_unix=row.created_at_unix,
            pid=row.pid,
            memory_limit_mib=row.memory_limit_mib,
            state=row.state,
            expires_at_unix=row.expires_at_unix,
            expires_at=iso_time(row.expires_at_unix),
            on_timeout=row.on_timeout,
            idle_timeout_s=row.idle_timeout_s,
            last_active_at=iso_time(self.activity.last_active(sandbox_id)),
            timeout_branch=row.timeout_branch,
            fork_ms=row.fork_ms,
            seed=row.seed,
            auto_resume=row.auto_resume,
            evictable=row.evictable,
            metadata=row.metadata,
            has_branched=branches > 0,
            branch_count=branches,
            last_branch_memory_path=last_branch.get(sandbox_id),
        )

    def list(
        self,
        state: str | None = None,
        snapshot: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The sandboxes in ``state``, of ``snapshot``, labelled with all of ``metadata``."""
        if state is not None and state not in SANDBOX_STATES:
            raise Invalid(f"unknown state {state!r}: one of {', '.join(SANDBOX_STATES)}")
        facts = self._branch_facts()
        return [
            self._info(r, facts)  # a listing touches none of them
            for r in self.store.list_sandboxes()
            if (state is None or r.state == state)
            and (snapshot is None or r.snapshot_tag == snapshot)
            and labelled(r.metadata, metadata)
        ]

    def set_timeout(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        """The sandbox's timeout, ``req.timeout_s`` from now (longer or shorter than it
        was), or none; :class:`Conflict` for a dead one."""
        row = self.records.sandbox_row(sandbox_id)
        if row.state == SandboxState.DEAD:
            raise Conflict(f"sandbox {sandbox_id!r} is dead")
        changes: SandboxChanges = {"expires_at_unix": expiry_in(req.timeout_s)}
        if req.on_timeout is not None:
            changes["on_timeout"] = req.on_timeout
        if "idle_timeout_s" in req.model_fields_set:
            changes["idle_timeout_s"] = req.idle_timeout_s
        self.store.update_sandbox(sandbox_id, **changes)
        return self.info(sandbox_id)

    def update(self, sandbox_id: str, req: SandboxUpdate) -> SandboxInfo:
        """Change whether reclaim may take it and whether a request wakes it;
        :class:`Conflict` for a dead one."""
        row = self.records.sandbox_row(sandbox_id)
        if row.state == SandboxState.DEAD:
            raise Conflict(f"sandbox {sandbox_id!r} is dead")
        changes: SandboxChanges = {}
        if req.evictable is not None:
            changes["evictable"] = req.evictable
        if req.auto_resume is not None:
            changes["auto_resume"] = req.auto_resume
        if changes:
            self.store.update_sandbox(sandbox_id, **changes)
        return self.info(sandbox_id)

    async def kill(self, sandbox_id: str, force: bool = False) -> None:
        """Kill it (its stop hook first, unless ``force``)."""
        if self.records.sandbox_row(sandbox_id).state == SandboxState.STARTING:
            raise Conflict(f"sandbox {sandbox_id!r} is still starting; retry shortly")
        if self.holds.is_waking(sandbox_id):
            raise Conflict(f"sandbox {sandbox_id!r} is waking from hibernation; retry shortly")
        await self.vms.remove(sandbox_id, "user", hook=not force)
