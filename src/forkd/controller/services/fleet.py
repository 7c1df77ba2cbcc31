"""The daemon's live VMs: which sandbox runs in which VM, and how one stops.

Every service shares one :class:`Fleet`. It also holds what spans services:
tags being created, the count of operations that hold volume layers no
registry names yet, the pool of QEMU processes started ahead of forks, the
cgroup hierarchy VMs run in, and admission: the sandboxes and guest memory
in use or being started, checked against the daemon's caps.
The VM driver is a parameter, so unit tests run the real services and the
real app over a fake driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from forkd.controller.metrics import Metrics
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.settings import Settings
from forkd.controller.store import SandboxRow, SnapshotRow, Store
from forkd.errors import Conflict, ForkdError, NotFound, OverCapacity
from forkd.guest.image import Image
from forkd.limits import check_tag
from forkd.states import SandboxState
from forkd.vmm import cgroups
from forkd.vmm.egress import Egress
from forkd.vmm.network import HostNetwork
from forkd.vmm.pool import ForkPool
from forkd.vmm.volumes import Attachment


class VMDriver(Protocol):
    """What the services need of :class:`forkd.vmm.vm.VM`'s constructors: the keywords
    they pass, and a :class:`SandboxVM` back."""

    async def boot(
        self,
        image: Image,
        *,
        run_root: Path,
        memory_mib: int = ...,
        vcpus: int = ...,
        accel_name: str | None = ...,
        vm_id: str | None = ...,
        boot_timeout: float = ...,
        attach: Sequence[Attachment] = ...,
        host_network: HostNetwork | None = ...,
        egress_policy: Egress | None = ...,
        cgroup: cgroups.Placement | None = ...,
    ) -> SandboxVM: ...
    async def restore(
        self,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = ...,
        detach: bool = ...,
        host_network: HostNetwork | None = ...,
        egress_policy: Egress | None = ...,
        cgroup: cgroups.Placement | None = ...,
        hostname: str | None = ...,
    ) -> SandboxVM: ...
    async def spawn_incoming(
        self,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = ...,
        detach: bool = ...,
        host_network: HostNetwork | None = ...,
        cgroup: cgroups.Placement | None = ...,
    ) -> SandboxVM: ...
    async def adopt(self, run_dir: Path, paused: bool = False) -> SandboxVM: ...


PING_WAIT_SECS = 3.0

log = logging.getLogger(__name__)


def vm_id_prefixes(id_prefix: str) -> tuple[str, ...]:
    """How the ids of one daemon's VMs start: its sandboxes and its templates."""
    return (f"sb-{id_prefix}-", f"tpl-{id_prefix}-")


def _cgroup_hierarchy(settings: Settings) -> cgroups.Hierarchy:
    """Where VMs' groups go. The groups of VMs that died while no daemon watched are
    removed by :meth:`Lifecycle.remove_stray_cgroups`, once the strays are killed."""
    if settings.cgroup_parent is None:
        return cgroups.NoCgroups("turned off (--cgroup-parent none)")
    found = cgroups.detect(settings.cgroup_root, settings.cgroup_parent)
    (log.info if found.limits_memory else log.warning)("VM cgroups: %s", found.describe())
    return found


@dataclass
class Admission:
    """Room held for VMs one request is starting, until they run or fail."""

    sandboxes: int  # sandboxes it starts, each of sandbox_mib guest RAM
    sandbox_mib: int
    template_mib: int = 0  # a template build's guest RAM
    ids: set[str] = field(default_factory=set)  # its sandboxes' ids, once known


class Fleet:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        driver: VMDriver | None = None,
    ) -> None:
        if driver is None:
            from forkd.vmm.vm import VM

            driver = VM  # its classmethods are the constructors: mypy checks they fit
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.driver = driver
        self.vms: dict[str, SandboxVM] = {}  # sandbox id -> its running VM
        # One branch of a given sandbox at a time: a second one must not resume
        # the source while the first is still capturing it.
        # A branch holds its lock object itself; the entry goes once the sandbox is gone.
        self.branch_locks: dict[str, asyncio.Lock] = {}
        # Branches copying a hibernated sandbox's state: it is not discarded under them.
        self._reading_hibernated: dict[str, list[asyncio.Event]] = {}
        # How many times each sandbox was paused: a call that failed across a pause is retried.
        self.pauses: dict[str, int] = {}
        self._tags_in_flight: set[str] = set()
        # Template builds and forks hold volume layers that no registry entry
        # names yet: no layer collection while any is in progress.
        self.volume_ops = 0
        self.events = EventBus()  # lifecycle events: every service publishes here
        self.hibernated = HibernatedFiles(settings.snapshot_root)
        self.waking: set[str] = set()  # hibernated sandboxes being restored: not killed
        # Idle timeouts: when each sandbox was last touched by an API call or seen
        # writing output, and how much output its processes had written then.
        self.last_active: dict[str, float] = {}
        self.output_seen: dict[str, int] = {}
        self.network = HostNetwork(settings.sandbox_cidr, settings.network)
        self.cgroups = _cgroup_hierarchy(settings)
        self._admitted: list[Admission] = []  # requests starting VMs right now
        self.pool: ForkPool[SandboxVM] = ForkPool(
            settings.run_dir,
            per_snapshot=settings.pool_size,
            detach=True,  # a pooled QEMU becomes a sandbox that outlives the daemon
            new_id=store.next_sandbox_id,
            spawn=functools.partial(
                driver.spawn_incoming, host_network=self.network, cgroup=self.placement()
            ),
            warm=True,  # restored ahead and stopped: a fork is cont + one agent call
            memory_cap_mib=settings.pool_memory_mib,
        )
        settings.snapshot_root.mkdir(parents=True, exist_ok=True)
        settings.run_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------- tags

    @contextlib.contextmanager
    def reserve_tag(self, tag: str) -> Iterator[str]:
        """Hold ``tag`` for a snapshot being created; :class:`Conflict` if taken."""
        if tag in self._tags_in_flight:
            raise Conflict(f"a snapshot named {tag!r} is being created")
        if self.store.get_snapshot(tag) is not None or (self.settings.snapshot_root / tag).exists():
            raise Conflict(f"snapshot {tag!r} already exists")
        over = [r.tag for r in self.store.list_snapshots() if r.base_tag == tag]
        if over:  # a new snapshot of that tag would not be what they are diffs over
            raise Conflict(
                f"snapshot {tag!r} was deleted but diff snapshots {', '.join(over)} are still "
                "recorded over it: delete them first"
            )
        self._tags_in_flight.add(tag)
        try:
            yield tag
        finally:
            self._tags_in_flight.discard(tag)

    @contextlib.contextmanager
    def holding_volume_layers(self) -> Iterator[None]:
        self.volume_ops += 1
        try:
            yield
        finally:
            self.volume_ops -= 1

    # ------------------------------------------------------------- admission

    def placement(self, memory_limit_mib: int | None = None) -> cgroups.Placement | None:
        """Where a new VM's cgroup goes (None: the host has none for us)."""
        if not self.cgroups.limits_memory:
            return None
        return cgroups.Placement(self.cgroups, memory_limit_mib)

    def in_use(self) -> tuple[int, int]:
        """Sandboxes and guest MiB running or being started (template builds: MiB only)."""
        running = {sid: vm.machine.memory_mib for sid, vm in self.vms.items()}
        count, mib = len(running), sum(running.values())
        for held in self._admitted:
            pending = held.sandboxes - len(held.ids & running.keys())  # not yet in self.vms
            count += pending
            mib += pending * held.sandbox_mib + held.template_mib
        return count, mib

    @contextlib.contextmanager
    def admit(
        self, what: str, sandboxes: int, sandbox_mib: int = 0, template_mib: int = 0
    ) -> Iterator[Admission]:
        """Hold room for VMs about to start; :class:`OverCapacity` when a cap would be passed.

        Checked and held in one step (no await between): two requests racing
        for the last slots cannot both get them. The room is given back when
        the block ends; by then the sandboxes are in :attr:`vms` or gone.
        """
        count, mib = self.in_use()
        cap = self.settings.max_sandboxes
        if cap is not None and count + sandboxes > cap:
            raise OverCapacity(
                f"{what}: {sandboxes} more sandboxes would make {count + sandboxes}, over this "
                f"daemon's cap of {cap} (--max-sandboxes); {count} are running or starting"
            )
        need = sandboxes * sandbox_mib + template_mib
        mem_cap = self.settings.max_guest_memory_mib
        if mem_cap is not None and mib + need > mem_cap:
            raise OverCapacity(
                f"{what}: needs {need} MiB of guest memory and {mib} of this daemon's "
                f"{mem_cap} MiB are in use or being started (--max-guest-memory)"
            )
        held = Admission(sandboxes, sandbox_mib, template_mib)
        self._admitted.append(held)
        try:
            yield held
        finally:
            self._admitted.remove(held)

    # ------------------------------------------------------------- rows

    def snapshot_row(self, tag: str) -> SnapshotRow:
        check_tag(tag)
        row = self.store.get_snapshot(tag)
        if row is None:
            raise NotFound(f"snapshot {tag!r} not found")
        return row

    def sandbox_row(self, sandbox_id: str) -> SandboxRow:
        """The sandbox's record, for a call touching it (its idle clock starts again)."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        self.touch(sandbox_id)
        return row

    def count_pause(self, sandbox_id: str) -> None:
        """The sandbox's vCPUs were just stopped: a guest call that failed across this
        pause is retried (see :attr:`pauses`)."""
        self.pauses[sandbox_id] = self.pauses.get(sandbox_id, 0) + 1

    # ------------------------------------------------------------- idleness

    def touch(self, sandbox_id: str) -> None:
        """Something used the sandbox now: its idle timeout counts from here."""
        self.last_active[sandbox_id] = time.time()

    def idle_since(self, row: SandboxRow) -> float:
        """When the sandbox was last active (a daemon's start counts as activity)."""
        return self.last_active.setdefault(row.id, time.time())

    def idle_expired(self, row: SandboxRow) -> bool:
        """Whether the running sandbox has been idle past its idle timeout."""
        if row.idle_timeout_s is None or row.state != "running":
            return False
        return time.time() - self.idle_since(row) >= row.idle_timeout_s

    # ------------------------------------------------------------- VMs

    def live(self, sandbox_id: str, paused_ok: bool = False) -> SandboxVM:
        """The running VM of ``sandbox_id``; :class:`Conflict` when it is not running
        (or is paused, unless ``paused_ok``: its guest answers nothing while paused)."""
        row = self.sandbox_row(sandbox_id)
        vm = self.vms.get(sandbox_id)
        if row.state == "hibernated":
            raise Conflict(f"sandbox {sandbox_id!r} is hibernated: resume it first")
        if vm is None or row.state == "dead":
            raise Conflict(f"sandbox {sandbox_id!r} is {row.state}, not running")
        if row.state == "paused" and not paused_ok:
            raise Conflict(f"sandbox {sandbox_id!r} is paused: resume it first")
        if not vm.is_alive():
            raise Conflict(f"sandbox {sandbox_id!r} is dead (its QEMU exited)")
        return vm

    async def answers(self, vm: SandboxVM) -> bool:
        """Whether a VM whose QEMU may just have died still runs and answers."""
        try:
            await asyncio.wait_for(vm.ping(), PING_WAIT_SECS)
        except (ForkdError, TimeoutError):
            return False
        return vm.is_alive()

    @contextlib.contextmanager
    def reading_hibernated(self, sandbox_id: str) -> Iterator[None]:
        """A branch copies the hibernated state of ``sandbox_id`` meanwhile."""
        done = asyncio.Event()
        self._reading_hibernated.setdefault(sandbox_id, []).append(done)
        try:
            yield
        finally:
            done.set()
            readers = self._reading_hibernated[sandbox_id]
            readers.remove(done)
            if not readers:
                del self._reading_hibernated[sandbox_id]

    async def _discard_hibernated(self, sandbox_id: str) -> None:
        """Delete the sandbox's hibernated state once no branch is copying it."""
        for done in list(self._reading_hibernated.get(sandbox_id, ())):
            await done.wait()
        self.hibernated.discard(sandbox_id)

    async def mark_dead(self, sandbox_id: str) -> None:
        """The sandbox's VM is gone: keep its record, state ``dead``."""
        self.pauses.pop(sandbox_id, None)
        self.last_active.pop(sandbox_id, None)
        self.output_seen.pop(sandbox_id, None)
        vm = self.vms.pop(sandbox_id, None)
        exited = vm is None or not vm.is_alive()  # on its own, or stopped by us now
        if vm is not None:
            await vm.kill()
        await self._discard_hibernated(sandbox_id)
        row = self.store.get_sandbox(sandbox_id)
        was = None if row is None else self.store.set_sandbox_state(sandbox_id, SandboxState.DEAD)
        if was is not None and was != SandboxState.DEAD:
            self.events.publish("died" if exited else "killed", sandbox_id=sandbox_id)
        # Only now: a branch that started meanwhile queued on this lock (no new one can
        # start on a dead sandbox); one in flight holds the object itself.
        self.branch_locks.pop(sandbox_id, None)

    async def remove(self, sandbox_id: str) -> None:
        """Kill the sandbox's VM (if any), delete its files and its record."""
        self.pauses.pop(sandbox_id, None)
        self.last_active.pop(sandbox_id, None)
        self.output_seen.pop(sandbox_id, None)
        vm = self.vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        else:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None:
                shutil.rmtree(row.run_dir, ignore_errors=True)
        await self._discard_hibernated(sandbox_id)
        row = self.store.get_sandbox(sandbox_id)
        self.store.delete_sandbox(sandbox_id)
        self.branch_locks.pop(sandbox_id, None)  # as in mark_dead: once it is gone
        if row is not None and row.state not in ("starting", "dead"):  # a failed fork: none
            self.events.publish("killed", sandbox_id=sandbox_id)

    def all_vms(self) -> list[SandboxVM]:
        """Every VM the daemon holds: sandboxes and pooled QEMU processes."""
        return [*self.vms.values(), *self.pool.all_vms()]
