"""Sandboxes: fork them from snapshots, describe, kill, and talk to their guests."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, overload

from pydantic import ValidationError

from forkd import agent_wire as wire
from forkd import limits
from forkd.controller.models import (
    SANDBOX_STATES,
    DisplayOutput,
    EvalInterrupt,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    FileEntry,
    PingResult,
    SandboxCreate,
    SandboxInfo,
    SandboxUpdate,
    TimeoutRequest,
)
from forkd.controller.services.admission import Admission, AdmissionControl
from forkd.controller.services.fleet import Fleet
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.snapshots import SnapshotService, memory_file
from forkd.controller.services.waking import Waker
from forkd.controller.store_rows import (
    SandboxChanges,
    SandboxRow,
    SnapshotRow,
    labelled,
    merged_labels,
    now,
)
from forkd.errors import (
    AgentError,
    Busy,
    Conflict,
    Forbidden,
    ForkdError,
    GuestError,
    Invalid,
    NotFound,
    OverCapacity,
    Unavailable,
    VMError,
)
from forkd.states import SandboxState, SnapshotStatus, VMState
from forkd.vmm.agent.ops import EVAL_IMAGE_REFUSALS
from forkd.vmm.jail import cgroups, egress
from forkd.vmm.jail.egress import Egress
from forkd.vmm.snapshot import files as snapshot_files

T = TypeVar("T")


FORK_PARALLELISM = 4  # restores in flight at once (each is a QEMU start)

# Failures a fork passes on as they are; any other one is "forking failed" (500).
_CALLERS_FAULT = (Invalid, NotFound, Conflict, Busy, Unavailable)

# The guest's exception, when the agent answered with one, says whose fault it was.
_GUEST_REFUSALS: dict[str, type[ForkdError]] = {
    "FileNotFoundError": NotFound,
    "IsADirectoryError": Invalid,
    "NotADirectoryError": Invalid,
    "FileExistsError": Conflict,
    "ValueError": Invalid,
    "PermissionError": Forbidden,
    # Background processes (the proc_* ops): no such pid, exited, too many running.
    "ProcessLookupError": NotFound,
    "BrokenPipeError": Conflict,
    "BlockingIOError": OverCapacity,
    # Any other refusal of the guest's filesystem (busy, read-only, full): its state.
    "OSError": Conflict,
}


# Eval in a container image without a usable python3: a 409, like any request the
# sandbox's state (here its image) cannot serve; the same body succeeds elsewhere.
EVAL_REFUSALS: dict[str, type[ForkdError]] = dict.fromkeys(EVAL_IMAGE_REFUSALS, Conflict)

EXIT_WAIT_SECS = 1.0  # for a QEMU whose agent channel just closed to finish exiting


async def _exited(vm: SandboxVM, wait: float) -> bool:
    """Whether ``vm``'s QEMU has exited, polling for ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while vm.is_alive():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


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
        fleet: Fleet,
        admission: AdmissionControl,
        waker: Waker,
        snapshots: SnapshotService,
    ) -> None:
        self.fleet = fleet
        self.admission = admission
        self.waker = waker
        self.snapshots = snapshots
        self._fork_slots = asyncio.Semaphore(FORK_PARALLELISM)

    # ------------------------------------------------------------ fork

    async def create(self, req: SandboxCreate, pool: bool = True) -> list[SandboxInfo]:
        """Fork ``req.n`` sandboxes from a snapshot: all of them, or none. ``pool``
        False: a one-off fork (an explore's, a diff's) that neither takes from the warm
        pool nor teaches it the snapshot's demand."""
        tag = limits.check_tag(req.snapshot_tag)
        row = self.fleet.snapshot_row(tag)
        problem = self.snapshots.unbootable_reason(row)
        if problem is not None:
            raise Conflict(f"snapshot {tag!r} is not bootable: {problem}")
        if req.per_child_netns and not self.fleet.network.enabled:
            raise Unavailable(
                f"per_child_netns needs network namespaces: {self.fleet.network.reason}"
            )
        _lifetime(req)  # refused here, before anything is made
        if req.seed is not None and req.seed + req.n - 1 > limits.MAX_SEED:
            raise Invalid(f"seed {req.seed} + n {req.n} - 1 is over {limits.MAX_SEED}")
        policy = egress.requested(req.egress, req.internet, req.network)
        snap_dir = Path(row.dir)
        machine = snapshot_files.load(snap_dir).machine
        if req.memory_limit_mib is not None and self.fleet.cgroups.limits_memory:
            cgroups.check_memory_limit(req.memory_limit_mib, machine.memory_mib, machine.accel)
        what = f"forking {req.n} from {tag!r}"
        self.admission.check_caps(what, req.n, machine.memory_mib)  # before any eviction
        await self.admission.make_room_for(req.n, snap_dir)
        with self.admission.admit(what, req.n, machine.memory_mib, origin=snap_dir) as held:
            return await self._fork_all(req, tag, snap_dir, policy, held, pool)

    async def _fork_all(
        self,
        req: SandboxCreate,
        tag: str,
        snap_dir: Path,
        policy: Egress | None,
        held: Admission,
        pool: bool,
    ) -> list[SandboxInfo]:
        pooled: list[SandboxVM] = []
        # Pooled QEMUs were started with the snapshot's policy and the default limit.
        if pool and policy is None and req.memory_limit_mib is None:
            self.fleet.pool.record_demand(snap_dir, req.n)
            while len(pooled) < req.n and (vm := self.fleet.pool.take(snap_dir)) is not None:
                pooled.append(vm)
        ids = [vm.id for vm in pooled]
        ids += [self.fleet.store.next_sandbox_id() for _ in range(req.n - len(pooled))]
        held.ids.update(ids)
        waiting = {vm.id: vm for vm in pooled}
        with self.fleet.holds.volume_layers():
            seeds = [None if req.seed is None else req.seed + i for i in range(len(ids))]
            results = await asyncio.gather(
                *(
                    self._fork_one(sid, req, snap_dir, waiting, policy, seed)
                    for sid, seed in zip(ids, seeds, strict=True)
                ),
                return_exceptions=True,
            )
        if pool and self.fleet.store.get_snapshot(tag) is not None:  # not deleted meanwhile
            self.fleet.pool.refill(snap_dir)
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
        return [self._info(self.fleet.sandbox_row(sid), facts) for sid in ids]

    async def _fork_one(
        self,
        sid: str,
        req: SandboxCreate,
        snap_dir: Path,
        waiting: dict[str, SandboxVM],
        policy: Egress | None,
        seed: int | None,
    ) -> None:
        fleet = self.fleet
        run_dir = fleet.settings.run_dir / sid
        fleet.store.add_sandbox(
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
                metadata=merged_labels(fleet.snapshot_row(req.snapshot_tag).metadata, req.metadata),
            )
        )
        async with self._fork_slots:
            vm = waiting.pop(sid, None)
            if vm is not None and vm.state == VMState.WARM:
                await vm.claim(seed=seed)  # restored ahead of time: cont, a fresh identity
            elif vm is not None:
                await vm.finish_restore(seed=seed)
            else:
                vm = await fleet.driver.restore(
                    snap_dir,
                    run_root=fleet.settings.run_dir,
                    vm_id=sid,
                    detach=True,
                    host_network=fleet.network,
                    egress_policy=policy,
                    cgroup=fleet.placement(req.memory_limit_mib),
                    seed=seed,
                )
        fleet.vms[sid] = vm
        fork_ms = round(vm.ready_ms or 0, 1)
        fleet.store.set_sandbox_state(sid, SandboxState.RUNNING, pid=vm.pid, fork_ms=fork_ms)
        fleet.metrics.fork_seconds.observe((vm.ready_ms or 0) / 1000)
        fleet.events.publish(
            "created", sandbox_id=sid, snapshot_tag=req.snapshot_tag, fork_ms=fork_ms
        )

    async def _undo(self, ids: list[str], waiting: dict[str, SandboxVM]) -> None:
        for vm in waiting.values():
            await vm.kill()
        removed = await asyncio.gather(
            *(self.fleet.remove(sid) for sid in ids), return_exceptions=True
        )
        for sid, result in zip(ids, removed, strict=True):
            if isinstance(result, BaseException):  # its remove stopped before its row
                self.fleet.store.delete_sandbox(sid)

    # ------------------------------------------------------------ read, kill

    def info(self, sandbox_id: str) -> SandboxInfo:
        return self._info(self.fleet.sandbox_row(sandbox_id), self._branch_facts())

    def _branch_facts(self) -> tuple[dict[str, int], dict[str, str]]:
        """Per sandbox: how many branches it took, and the memory file of its latest one
        still registered (the original forkd's ``last_branch_memory_path``)."""
        latest: dict[str, SnapshotRow] = {}
        for snap in self.fleet.store.list_snapshots():
            source = snap.branched_from
            if source is None or snap.status != SnapshotStatus.READY:
                continue
            if source not in latest or snap.created_at_unix >= latest[source].created_at_unix:
                latest[source] = snap
        shown = self.fleet.settings.shown_path
        paths = {source: shown(memory_file(snap)) for source, snap in latest.items()}
        return self.fleet.store.branch_counts(), paths

    def _info(self, row: SandboxRow, facts: tuple[dict[str, int], dict[str, str]]) -> SandboxInfo:
        sandbox_id = row.id
        vm = self.fleet.vms.get(sandbox_id)
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
            last_active_at=iso_time(self.fleet.activity.last_active(sandbox_id)),
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
            for r in self.fleet.store.list_sandboxes()
            if (state is None or r.state == state)
            and (snapshot is None or r.snapshot_tag == snapshot)
            and labelled(r.metadata, metadata)
        ]

    def set_timeout(self, sandbox_id: str, req: TimeoutRequest) -> SandboxInfo:
        """The sandbox's timeout, ``req.timeout_s`` from now (longer or shorter than it
        was), or none; :class:`Conflict` for a dead one."""
        row = self.fleet.sandbox_row(sandbox_id)
        if row.state == SandboxState.DEAD:
            raise Conflict(f"sandbox {sandbox_id!r} is dead")
        changes: SandboxChanges = {"expires_at_unix": expiry_in(req.timeout_s)}
        if req.on_timeout is not None:
            changes["on_timeout"] = req.on_timeout
        if "idle_timeout_s" in req.model_fields_set:
            changes["idle_timeout_s"] = req.idle_timeout_s
        self.fleet.store.update_sandbox(sandbox_id, **changes)
        return self.info(sandbox_id)

    def update(self, sandbox_id: str, req: SandboxUpdate) -> SandboxInfo:
        """Change whether reclaim may take it and whether a request wakes it;
        :class:`Conflict` for a dead one."""
        row = self.fleet.sandbox_row(sandbox_id)
        if row.state == SandboxState.DEAD:
            raise Conflict(f"sandbox {sandbox_id!r} is dead")
        changes: SandboxChanges = {}
        if req.evictable is not None:
            changes["evictable"] = req.evictable
        if req.auto_resume is not None:
            changes["auto_resume"] = req.auto_resume
        if changes:
            self.fleet.store.update_sandbox(sandbox_id, **changes)
        return self.info(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        if self.fleet.sandbox_row(sandbox_id).state == SandboxState.STARTING:
            raise Conflict(f"sandbox {sandbox_id!r} is still starting; retry shortly")
        if self.fleet.holds.is_waking(sandbox_id):
            raise Conflict(f"sandbox {sandbox_id!r} is waking from hibernation; retry shortly")
        await self.fleet.remove(sandbox_id)

    # ------------------------------------------------------------ guest

    async def guest(
        self,
        sandbox_id: str,
        call: Callable[[SandboxVM], Awaitable[T]],
        refusals: Mapping[str, type[ForkdError]] | None = None,
        wake: bool = True,
    ) -> T:
        """``call(vm)`` on the sandbox's running VM, with agent failures classified.

        ``refusals`` overrides entries of the table from the guest's exception
        names to forkd errors, for a call where one name means something else.
        ``wake``: a paused or hibernated sandbox is resumed first (:mod:`.waking`);
        without it, such a sandbox is a 409.
        """
        vm = await self.waker.running(sandbox_id) if wake else self.fleet.live(sandbox_id)
        try:
            return await call(vm)
        except AgentError as exc:
            # No answer at all (kind None): QEMU may be exiting (killed at its
            # memory cap, say) and its channel closed first. Give it a moment.
            if await _exited(vm, EXIT_WAIT_SECS if exc.kind is None else 0):
                await self.fleet.mark_dead(sandbox_id)
                raise Conflict(f"sandbox {sandbox_id!r} died: {exc}") from exc
            refusal = {**_GUEST_REFUSALS, **(refusals or {})}.get(exc.kind or "")
            if refusal is not None:
                raise refusal(str(exc)) from exc
            raise

    async def ping(self, sandbox_id: str) -> PingResult:
        res = await self.guest(sandbox_id, lambda vm: vm.ping())
        return PingResult.model_validate({**res, "pong": True})

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        res = await self.guest(
            sandbox_id,
            lambda vm: vm.exec(
                req.args,
                timeout=req.timeout_secs,
                cwd=req.cwd,
                env=req.env or None,
                stdin=req.stdin,
                user=req.user,
            ),
        )
        return ExecResult(
            stdout=res.get("stdout", ""),
            stderr=res.get("stderr", ""),
            exit_code=res.get("exit_code"),
            timed_out=res.get("timed_out", False),
            stdout_truncated=res.get("stdout_truncated", False),
            stderr_truncated=res.get("stderr_truncated", False),
            duration_ms=res.get("duration_ms"),
        )

    async def eval(self, sandbox_id: str, req: EvalRequest) -> EvalResult:
        res = await self.guest(
            sandbox_id,
            lambda vm: vm.eval(req.code, timeout=req.timeout_s),
            refusals=EVAL_REFUSALS,
        )
        error = res.get("error")
        return EvalResult(
            result=res.get("result"),
            error=error_summary(error) if error else error,
            traceback=error or None,
            exit_code=res.get("exit_code", 0),
            stdout=res.get("stdout", ""),
            stderr=res.get("stderr", ""),
            display=[DisplayOutput(**item) for item in res.get("display", [])],
            display_truncated=res.get("display_truncated", False),
            timed_out=res.get("timed_out", False),
        )

    async def eval_interrupt(self, sandbox_id: str) -> EvalInterrupt:
        # The op takes no parameter: a refusal means an agent older than it.
        interrupted = await self.guest(
            sandbox_id, lambda vm: vm.eval_interrupt(), refusals={"ValueError": Conflict}
        )
        return EvalInterrupt(interrupted=interrupted)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        path = limits.check_guest_path(path)
        return await self.guest(sandbox_id, lambda vm: vm.read_file(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> int:
        path = limits.check_guest_path(path)
        return await self.guest(sandbox_id, lambda vm: vm.write_file(path, data))

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileEntry]:
        path = limits.check_guest_path(path)
        entries = await self.guest(sandbox_id, lambda vm: vm.list_dir(path))
        return _file_entries(entries)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool) -> None:
        path = limits.check_guest_path(path)
        await self.guest(sandbox_id, lambda vm: vm.remove(path, recursive))


def _file_entries(entries: Any) -> builtins.list[FileEntry]:
    """The guest's file listing as FileEntry models, within the agent's own bound (its
    MAX_LIST_ENTRIES): :class:`GuestError` for more, or for an entry of the wrong shape."""
    if not isinstance(entries, builtins.list) or len(entries) > wire.MAX_LIST_ENTRIES:
        raise GuestError(
            f"the guest's file listing is not a list of at most {wire.MAX_LIST_ENTRIES} entries"
        )
    try:
        return [FileEntry.model_validate(e) for e in entries]
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"]
        raise GuestError(f"the guest's file listing has a malformed entry: {problem}") from None


def error_summary(text: str) -> str:
    """A traceback's last line (``NameError: name 'x' is not defined``): the summary the
    original forkd's eval answered as ``error``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text
