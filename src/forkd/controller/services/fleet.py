"""The daemon's registry of live VMs: which sandbox runs in which VM, its record,
and how one stops.

The services share one :class:`Fleet`: the VMs, the store, the events, the
egress proxy. What spans services has a home of its own beside it:
:class:`~forkd.controller.services.holds.Holds` (the named guards one request
takes against another) and :class:`~forkd.controller.services.activity.Activity`
(idle clocks and pause counts); the caps
(:class:`~forkd.controller.services.admission.AdmissionControl`) and waking a
sandbox for a request (:class:`~forkd.controller.services.waking.Waker`) are
services of their own, built on it. The VM driver is a parameter, so unit tests
run the real services and the real app over a fake driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import logging
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from forkd.controller.metrics import Metrics
from forkd.controller.services.activity import Activity
from forkd.controller.services.egress_audit import EgressReport
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.holds import Holds
from forkd.controller.services.host_memory import MemoryWatch
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow
from forkd.egress.ca import EgressCA
from forkd.egress.intercept import Interceptor, SecretSource
from forkd.egress.proxy import EgressProxy
from forkd.egress.records import EgressLog
from forkd.egress.resolver import PinnedHosts, Resolver
from forkd.errors import Conflict, ForkdError, NotFound
from forkd.guest.image import Image
from forkd.limits import check_tag
from forkd.states import SandboxState
from forkd.vmm.jail import cgroups
from forkd.vmm.jail.egress import Egress
from forkd.vmm.jail.network import HostNetwork
from forkd.vmm.pool import ForkPool
from forkd.vmm.volumes.disks import Attachment


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
        seed: int | None = ...,
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


# After a failed branch: how long its source has to answer before it is taken for
# dead and killed. A guest just resumed on a loaded host (TCG, busy cores) can take
# seconds; killing a live sandbox loses its state, so this is generous.
PING_WAIT_SECS = 10.0

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


class Fleet:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        metrics: Metrics,
        secrets: SecretSource,
        driver: VMDriver | None = None,
    ) -> None:
        """``secrets``: what the egress proxy puts into intercepted requests."""
        if driver is None:
            from forkd.vmm.vm import VM

            driver = VM  # its classmethods are the constructors: mypy checks they fit
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.driver = driver
        self.vms: dict[str, SandboxVM] = {}  # sandbox id -> its running VM
        self.holds = Holds()
        self.activity = Activity()
        self.memory = MemoryWatch(
            lambda: self.vms, cgroup_root=settings.cgroup_root, cgroup_parent=settings.cgroup_parent
        )
        self.events = EventBus()  # lifecycle events: every service publishes here
        # Sandboxes reclaim is hibernating now: set once each one is (.reclaim).
        self.evicting: dict[str, asyncio.Event] = {}
        self.hibernated = HibernatedFiles(settings.snapshot_root)
        self.network = HostNetwork(
            settings.sandbox_cidr, settings.network, settings.egress_host_networks
        )
        self.egress_ca = EgressCA(settings.state_dir)  # made at the first interception
        self.egress_report = EgressReport(self.events)
        self.egress = EgressProxy(
            Resolver(PinnedHosts(settings.egress_hosts)),
            settings.sandbox_cidr,
            EgressLog(self.egress_report),
            Interceptor(self.egress_ca, secrets, settings.egress_ca_file),
            dns_upstream=self.network.resolver,
            rate=settings.egress_rate,
        )
        if settings.egress_proxy:
            self.network.use_egress(self.egress)
        self.cgroups = _cgroup_hierarchy(settings)
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
        if self.store.get_snapshot(tag) is not None or (self.settings.snapshot_root / tag).exists():
            raise Conflict(f"snapshot {tag!r} already exists")
        over = [r.tag for r in self.store.list_snapshots() if r.base_tag == tag]
        if over:  # a new snapshot of that tag would not be what they are diffs over
            raise Conflict(
                f"snapshot {tag!r} was deleted but diff snapshots {', '.join(over)} are still "
                "recorded over it: delete them first"
            )
        with self.holds.new_tag(tag):
            yield tag

    # ------------------------------------------------------------- placement

    def vm_memory(self) -> dict[str, int]:
        """Each sandbox VM's guest memory, in MiB (for the caps)."""
        return {sid: vm.machine.memory_mib for sid, vm in self.vms.items()}

    def placement(self, memory_limit_mib: int | None = None) -> cgroups.Placement | None:
        """Where a new VM's cgroup goes (None: the host has none for us)."""
        if not self.cgroups.limits_memory:
            return None
        return cgroups.Placement(self.cgroups, memory_limit_mib)

    # ------------------------------------------------------------- rows

    def snapshot_row(self, tag: str) -> SnapshotRow:
        check_tag(tag)
        row = self.store.get_snapshot(tag)
        if row is None:
            tags = [r.tag for r in self.store.list_snapshots()]
            close = difflib.get_close_matches(tag, tags, n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise NotFound(f"snapshot {tag!r} not found{hint}")
        return row

    def sandbox_row(self, sandbox_id: str) -> SandboxRow:
        """The sandbox's record, for a call touching it (its idle clock starts again)."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        self.activity.touch(sandbox_id)
        return row

    # ------------------------------------------------------------- VMs

    def live(self, sandbox_id: str, paused_ok: bool = False) -> SandboxVM:
        """The running VM of ``sandbox_id``; :class:`Conflict` when it is not running
        (or is paused, unless ``paused_ok``: its guest answers nothing while paused)."""
        row = self.sandbox_row(sandbox_id)
        vm = self.vms.get(sandbox_id)
        if row.state == SandboxState.HIBERNATED:
            raise Conflict(f"sandbox {sandbox_id!r} is hibernated: resume it first")
        if vm is None or row.state == SandboxState.DEAD:
            raise Conflict(f"sandbox {sandbox_id!r} is {row.state}, not running")
        if row.state == SandboxState.PAUSED and not paused_ok:
            raise Conflict(f"sandbox {sandbox_id!r} is paused: resume it first")
        if not vm.is_alive():
            raise Conflict(f"sandbox {sandbox_id!r} is dead (its QEMU exited)")
        return vm

    async def wrote_output(self, sandbox_id: str, vm: SandboxVM, timeout: float) -> bool | None:
        """Whether the sandbox's processes wrote since the last look (output is use,
        :meth:`Activity.output_written`: its idle clock starts again), or None if the
        guest did not answer within ``timeout``. An answer that is nonsense shows no
        output: a guest cannot keep itself busy by its answers."""
        try:
            listed = await asyncio.wait_for(vm.proc_list(), timeout)
        except (ForkdError, TimeoutError):
            return None
        return self.activity.output_written(sandbox_id, listed)

    async def wrote_nothing(self, sandbox_id: str, vm: SandboxVM, timeout: float) -> bool:
        """Whether the sandbox showed no output since the last look; a guest that does
        not answer within ``timeout`` shows none."""
        return await self.wrote_output(sandbox_id, vm, timeout) is not True

    async def answers(self, vm: SandboxVM) -> bool:
        """Whether a VM whose QEMU may just have died still runs and answers."""
        try:
            await asyncio.wait_for(vm.ping(), PING_WAIT_SECS)
        except (ForkdError, TimeoutError):
            return False
        return vm.is_alive()

    async def _discard_hibernated(self, sandbox_id: str) -> None:
        """Delete the sandbox's hibernated state once no branch is copying it."""
        await self.holds.hibernated_unread(sandbox_id)
        self.hibernated.discard(sandbox_id)

    async def mark_dead(self, sandbox_id: str) -> None:
        """The sandbox's VM is gone: keep its record, state ``dead``."""
        self.activity.forget(sandbox_id)
        vm = self.vms.pop(sandbox_id, None)
        exited = vm is None or not vm.is_alive()  # on its own, or stopped by us now
        if vm is not None:
            await vm.kill()
        await self._discard_hibernated(sandbox_id)
        row = self.store.get_sandbox(sandbox_id)
        was = None if row is None else self.store.set_sandbox_state(sandbox_id, SandboxState.DEAD)
        if was is not None and was != SandboxState.DEAD:
            self.events.publish("died" if exited else "killed", sandbox_id=sandbox_id)
        self.holds.forget_sandbox(sandbox_id)  # only now: see forget_sandbox

    async def remove(self, sandbox_id: str) -> None:
        """Kill the sandbox's VM (if any), delete its files and its record."""
        self.activity.forget(sandbox_id)
        self.activity.forget_counts(sandbox_id)
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
        self.holds.forget_sandbox(sandbox_id)  # as in mark_dead: once it is gone
        # (a failed fork, or one already dead, says nothing)
        if row is not None and row.state not in (SandboxState.STARTING, SandboxState.DEAD):
            self.events.publish("killed", sandbox_id=sandbox_id)

    def all_vms(self) -> list[SandboxVM]:
        """Every VM the daemon holds: sandboxes and pooled QEMU processes."""
        return [*self.vms.values(), *self.pool.all_vms()]
