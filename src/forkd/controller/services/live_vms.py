"""The daemon's registry of running VMs: which sandbox runs in which VM, and how
one stops (killed, or found dead).

It is a mapping of sandbox id to VM; the warm QEMU processes of the fork pool are
not in it until a fork takes one. A stop keeps the store, the events, the holds
and the idle clocks in step with the registry.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator, MutableMapping
from typing import Any

from forkd.controller.services.activity import Activity
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.holds import Holds
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.stop_hooks import StopHooks
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.errors import Conflict, ForkdError
from forkd.states import SandboxState
from forkd.vmm.jail import cgroups
from forkd.vmm.pool import ForkPool

# After a failed branch: how long its source has to answer before it is taken for
# dead and killed. A guest just resumed on a loaded host (TCG, busy cores) can take
# seconds; killing a live sandbox loses its state, so this is generous.
PING_WAIT_SECS = 10.0
DEAD = SandboxState.DEAD


def vm_id_prefixes(id_prefix: str) -> tuple[str, ...]:
    """How the ids of one daemon's VMs start: its sandboxes and its templates."""
    return (f"sb-{id_prefix}-", f"tpl-{id_prefix}-")


class LiveVMs(MutableMapping[str, SandboxVM]):
    def __init__(
        self,
        store: Store,
        records: Records,
        events: EventBus,
        holds: Holds,
        activity: Activity,
        hibernated: HibernatedFiles,
        pool: ForkPool[SandboxVM],
        hooks: StopHooks | None = None,
    ) -> None:
        self._vms: dict[str, SandboxVM] = {}  # sandbox id -> its running VM
        self.hooks = hooks  # what a sandbox runs before it is stopped (stop_hooks)
        self.store = store
        self.records = records
        self.events = events
        self.holds = holds
        self.activity = activity
        self.hibernated = hibernated
        self.pool = pool

    def __getitem__(self, sandbox_id: str) -> SandboxVM:
        return self._vms[sandbox_id]

    def __setitem__(self, sandbox_id: str, vm: SandboxVM) -> None:
        self._vms[sandbox_id] = vm

    def __delitem__(self, sandbox_id: str) -> None:
        del self._vms[sandbox_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._vms)

    def __len__(self) -> int:
        return len(self._vms)

    def memory_mib(self) -> dict[str, int]:
        """Each sandbox VM's guest memory, in MiB (for the caps)."""
        return {sid: vm.machine.memory_mib for sid, vm in self._vms.items()}

    def live(self, sandbox_id: str, paused_ok: bool = False) -> SandboxVM:
        """The running VM of ``sandbox_id``; :class:`Conflict` when it is not running
        (or is paused, unless ``paused_ok``: its guest answers nothing while paused)."""
        row = self.records.sandbox_row(sandbox_id)
        vm = self._vms.get(sandbox_id)
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
            listed = await asyncio.wait_for(vm.guest.proc_list(), timeout)
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
            await asyncio.wait_for(vm.guest.ping(), PING_WAIT_SECS)
        except (ForkdError, TimeoutError):
            return False
        return vm.is_alive()

    async def _discard_hibernated(self, sandbox_id: str) -> None:
        """Delete the sandbox's hibernated state once no branch is copying it."""
        await self.holds.hibernated_unread(sandbox_id)
        self.hibernated.discard(sandbox_id)

    async def mark_dead(self, sandbox_id: str, reason: str | None = None) -> None:
        """The sandbox's VM is gone: keep its record, state ``dead``. ``reason`` goes in
        the ``killed`` event (a VM that exited on its own is ``died``: ``guest_exited``)."""
        self.activity.forget(sandbox_id)
        vm = self._vms.pop(sandbox_id, None)
        exited = vm is None or not vm.is_alive()  # on its own, or stopped by us now
        # Read before kill() removes its group: the host's OOM killer ended its QEMU.
        oom = exited and cgroups.oom_killed(getattr(vm, "cgroup", None))
        if vm is not None:
            await vm.kill()
        await self._discard_hibernated(sandbox_id)
        row = self.store.get_sandbox(sandbox_id)
        with self.store.transaction():  # the event's outbox rows with the state change
            was = None if row is None else self.store.set_sandbox_state(sandbox_id, DEAD)
            if row is not None and was is not None and was != DEAD:
                why = ("oom" if oom else "guest_exited") if exited else reason
                self.events.publish(
                    "died" if exited else "killed", sandbox_id=sandbox_id, **_labels(row, why)
                )
        self.holds.forget_sandbox(sandbox_id)  # only now: see forget_sandbox

    async def remove(self, sandbox_id: str, reason: str | None = None, hook: bool = True) -> None:
        """Kill the sandbox's VM (if any), delete its files and its record; ``reason``
        (``user``, ``timeout``, ``daemon_shutdown``, ...) goes in the ``killed`` event.
        Its stop hook runs first, for the reasons of :data:`.stop_hooks.HOOKED` (unless
        not ``hook``)."""
        if self.hooks is not None:
            vm = self._vms.get(sandbox_id) if hook else None
            await self.hooks.before_removal(sandbox_id, vm, reason)
        self.activity.forget(sandbox_id)
        self.activity.forget_counts(sandbox_id)
        vm = self._vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        else:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None:
                shutil.rmtree(row.run_dir, ignore_errors=True)
        await self._discard_hibernated(sandbox_id)
        row = self.store.get_sandbox(sandbox_id)
        with self.store.transaction():  # the event's outbox rows with the deletion
            self.store.delete_sandbox(sandbox_id)
            # (a failed fork, or one already dead, says nothing)
            if row is not None and row.state not in (SandboxState.STARTING, DEAD):
                self.events.publish("killed", sandbox_id=sandbox_id, **_labels(row, reason))
        self.holds.forget_sandbox(sandbox_id)  # as in mark_dead: once it is gone

    def all_vms(self) -> list[SandboxVM]:
        """Every VM the daemon holds: sandboxes and pooled QEMU processes."""
        return [*self._vms.values(), *self.pool.all_vms()]


def _labels(row: SandboxRow, reason: str | None) -> dict[str, Any]:
    """What a ``killed`` or ``died`` event says of the sandbox: why (when known), its
    template and its labels (its record may be gone by the time anyone asks)."""
    fields: dict[str, Any] = {"snapshot_tag": row.snapshot_tag, "metadata": row.metadata}
    if reason is not None:
        fields["reason"] = reason
    return fields
