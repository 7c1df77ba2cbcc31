"""Hibernate and wake: a sandbox snapshotted to disk, its QEMU ended, and later
restored into a new QEMU with the same id, address, volumes and processes.

Hibernating is a snapshot of the sandbox as it is (paused first when it
runs; see :mod:`forkd.vmm.snapshot.live`), written to the sandbox's own
directory (:mod:`.hibernated_files`); once it is committed the store says
``hibernated`` and the QEMU is killed, which gives its memory back. Waking
restores that snapshot the way a fork does, under the sandbox's id, with
the address it had when that is still free. Whatever fails, the sandbox is
left as it was: running (or paused) when hibernating failed, hibernated
when waking failed.

A hibernated sandbox's timeout is cleared: like a snapshot, it costs only
disk until someone wakes it (``resume`` may set a new one). It survives a
daemon restart and a host reboot: nothing of it lives outside the state
directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd import tracing
from forkd.controller.services.activity import Activity
from forkd.controller.services.admission import AdmissionControl
from forkd.controller.services.disk_room import require_room
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.holds import Holds
from forkd.controller.services.launcher import Launcher
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.shared_volumes import SharedVolumes
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxChanges
from forkd.errors import Busy, Conflict, ForkdError, SnapshotError, StorageFull, VMError
from forkd.states import SandboxState
from forkd.vmm.jail.network import SandboxNet
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import live as live_snapshot
from forkd.vmm.snapshot.files import SnapshotLabels
from forkd.vmm.volumes.shares import mount as mount_shares

log = logging.getLogger(__name__)

WAKE_FAILED_CHARS = 500  # of a wake_failed event's reason


class HibernateService:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        activity: Activity,
        hibernated: HibernatedFiles,
        records: Records,
        vms: LiveVMs,
        events: EventBus,
    ) -> None:
        self.settings = settings
        self.store = store
        self.activity = activity
        self.hibernated = hibernated
        self.records = records
        self.vms = vms
        self.events = events

    async def hibernate(self, sandbox_id: str, *, keep_timeout: bool = False, **event: Any) -> None:
        """Snapshot the running or paused sandbox to disk and end its QEMU.

        The caller holds the sandbox's branch lock. Its timeout is cleared unless
        ``keep_timeout`` (reclaim's eviction: not the user's choice, so the sandbox's
        lifetime runs on while it sleeps). The ``hibernated`` event, with ``event``'s
        fields (reclaim's reason), is published with the state change.
        """
        row = self.records.sandbox_row(sandbox_id)
        if row.state == SandboxState.HIBERNATED:
            raise Conflict(f"sandbox {sandbox_id!r} is already hibernated")
        vm = self.vms.live(sandbox_id, paused_ok=True)
        self.check_disk(sandbox_id)
        was_running = row.state == SandboxState.RUNNING
        if was_running and self.vms.hooks is not None:  # the guest's own clean stop first
            await self.vms.hooks.run(sandbox_id, vm, "hibernate")
        if was_running:  # the snapshot then holds exactly this moment
            try:
                await vm.pause()
            except ForkdError as exc:
                if isinstance(exc, Busy) or vm.is_alive():
                    raise
                await self.vms.mark_dead(sandbox_id)
                raise Conflict(f"sandbox {sandbox_id!r} died while hibernating: {exc}") from exc
            self.activity.count_pause(sandbox_id)
        dest = self.hibernated.next_dir(sandbox_id)
        labels = SnapshotLabels(branched_from=sandbox_id, parent_tag=row.snapshot_tag)
        try:
            with tracing.span("hibernate", sandbox_id=sandbox_id):
                await live_snapshot.snapshot_running(vm, dest, labels)
        except live_snapshot.LiveSnapshotError as exc:
            raise await self._not_hibernated(sandbox_id, vm, was_running, exc) from exc
        if self.vms.get(sandbox_id) is not vm:  # killed meanwhile: nothing to keep
            self.hibernated.discard(sandbox_id)
            raise Conflict(f"sandbox {sandbox_id!r} was killed while hibernating")
        HibernatedFiles.save_network(dest, vm.net.to_json() if vm.net else None)
        changes: SandboxChanges = {"pid": None}
        if not keep_timeout:
            changes["expires_at_unix"] = None
        with self.store.transaction():  # the event's outbox rows with the state change
            self.store.set_sandbox_state(sandbox_id, SandboxState.HIBERNATED, **changes)
            self.events.publish("hibernated", sandbox_id=sandbox_id, **event)
        self.vms.pop(sandbox_id, None)
        await vm.kill()  # its memory is given back; its namespace goes with it
        self.hibernated.discard(sandbox_id, keep=dest)  # the state the VM mapped
        log.info("sandbox %s hibernated to %s", sandbox_id, dest)

    def check_disk(self, sandbox_id: str, also_mib: int = 0) -> None:
        """:class:`StorageFull`, before anything is written, unless the disk has the
        reserve free (:mod:`.disk_room`) and ``also_mib`` more."""
        need = self.settings.disk_reserve_mib + also_mib
        require_room(self.hibernated.root, need, f"hibernating {sandbox_id}")

    async def _not_hibernated(
        self,
        sandbox_id: str,
        vm: SandboxVM,
        was_running: bool,
        exc: live_snapshot.LiveSnapshotError,
    ) -> ForkdError:
        """Put the sandbox back as it was; the error to answer with."""
        if not exc.source_alive or not vm.is_alive():
            await self.vms.mark_dead(sandbox_id)
            return Conflict(f"sandbox {sandbox_id!r} died while hibernating: {exc}")
        if was_running:
            try:
                await vm.resume()
            except ForkdError as again:
                log.warning("sandbox %s stays paused: %s", sandbox_id, again)
                self.store.set_sandbox_state(sandbox_id, SandboxState.PAUSED)
        reason = exc.reason
        if isinstance(reason, StorageFull | Busy):
            return type(reason)(f"hibernating {sandbox_id}: {reason}")
        return VMError(f"hibernating sandbox {sandbox_id!r} failed: {exc}")


class WakeService:
    """A hibernated sandbox restored into a new QEMU: room is made for it first
    (reclaim may hibernate others), then it is admitted as a fork is."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        holds: Holds,
        hibernated: HibernatedFiles,
        records: Records,
        vms: LiveVMs,
        launcher: Launcher,
        admission: AdmissionControl,
        events: EventBus,
        shared: SharedVolumes,
    ) -> None:
        self.settings = settings
        self.store = store
        self.events = events
        self.holds = holds
        self.hibernated = hibernated
        self.records = records
        self.vms = vms
        self.launcher = launcher
        self.admission = admission
        self.shared = shared  # the volumes a woken sandbox mounts again

    async def wake(self, sandbox_id: str, announce: Callable[[], None] | None = None) -> None:
        """Restore the hibernated sandbox into a new QEMU, running; ``announce()``
        publishes the event saying so, in the transaction of the state change.

        The caller holds the sandbox's branch lock and has checked it is hibernated. A
        wake that fails publishes ``wake_failed`` with the error as its reason.
        """
        try:
            await self._wake(sandbox_id, announce)
        except ForkdError as exc:
            said = f"wake_failed: {exc}"[:WAKE_FAILED_CHARS]
            self.events.publish("wake_failed", sandbox_id=sandbox_id, reason=said)
            raise

    async def _wake(self, sandbox_id: str, announce: Callable[[], None] | None) -> None:
        row = self.records.sandbox_row(sandbox_id)
        state_dir = self.hibernated.latest(sandbox_id)
        if state_dir is None:
            raise Conflict(f"sandbox {sandbox_id!r} is hibernated but its state is missing")
        try:
            machine = (await asyncio.to_thread(snapshot_files.load, state_dir)).machine
        except SnapshotError as exc:  # its files were damaged on disk
            raise VMError(
                f"waking sandbox {sandbox_id!r} failed, it stays hibernated: {exc}"
            ) from exc
        await self.admission.make_room_for(1)
        with self.admission.admit(f"waking {sandbox_id}", 1, machine.memory_mib) as held:
            held.ids.add(sandbox_id)
            with self.holds.waking(sandbox_id):
                vm = await self._restore(sandbox_id, state_dir, row.memory_limit_mib)
            self.vms[sandbox_id] = vm
        with self.store.transaction():
            self.store.set_sandbox_state(sandbox_id, SandboxState.RUNNING, pid=vm.pid)
            if announce is not None:
                announce()
        # Older generations are no longer mapped by anything.
        self.hibernated.discard(sandbox_id, keep=state_dir)
        log.info("sandbox %s woke from %s in %.0f ms", sandbox_id, state_dir, vm.ready_ms or 0)

    async def _restore(
        self, sandbox_id: str, state_dir: Path, memory_limit_mib: int | None
    ) -> SandboxVM:
        net = HibernatedFiles.saved_network(state_dir)
        if net is not None and self.launcher.network.enabled:
            with contextlib.suppress(KeyError, ValueError, TypeError):
                index = SandboxNet.from_json(net).index
                if index is not None:
                    self.launcher.network.prefer(sandbox_id, index)
        # A crash between a wake's restore and its record leaves a run directory.
        shutil.rmtree(self.settings.run_dir / sandbox_id, ignore_errors=True)
        shares = self.shared.of_sandbox(sandbox_id)
        try:
            vm = await self.launcher.driver.restore(
                state_dir,
                run_root=self.settings.run_dir,
                vm_id=sandbox_id,
                detach=True,
                host_network=self.launcher.network,
                cgroup=self.launcher.placement(memory_limit_mib),
                hostname=sandbox_id,
                shares=shares,
            )
            try:  # the mounts it carried are dead (forkd.vmm.volumes.shares)
                await mount_shares(vm.guest.exec, shares)
            except BaseException:
                await vm.kill()
                raise
            return vm
        except ForkdError as exc:
            if isinstance(exc, (Busy, Conflict, StorageFull)):
                raise
            raise VMError(
                f"waking sandbox {sandbox_id!r} failed, it stays hibernated: {exc}"
            ) from exc
