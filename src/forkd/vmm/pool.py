"""QEMU processes started ahead of time for a snapshot's forks.

Starting QEMU (until its QMP socket answers) is a third of a fork's latency
under TCG, and translating the guest code of the first request most of the
rest. A pool keeps, for the snapshots forked most recently, a few QEMU
processes already mapped to the snapshot's ``memory.bin``. With ``warm``
(the daemon's choice) each is restored in the background and stopped again
(:mod:`forkd.vmm.warm_start`): a fork is then ``cont`` and one agent call
(:meth:`VM.claim`). Without it, each waits in ``-incoming defer`` and a fork
loads the device state, continues the vCPUs and waits for the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from forkd.errors import ForkdError
from forkd.vmm.vm_start import new_vm_id
from forkd.vmm.volumes.disks import Attachment

log = logging.getLogger(__name__)

DEMAND_WINDOW_SECS = 300.0  # fork requests this recent size a snapshot's pool
POOLED_VM_MIB_GUESS = 64  # a pooled QEMU's private memory before one was measured


class PooledVM(Protocol):
    """What the pool uses of the VMs it holds (:class:`forkd.vmm.vm.VM`'s)."""

    @property
    def id(self) -> str: ...
    @property
    def volumes(self) -> Sequence[Attachment]: ...
    def is_alive(self) -> bool: ...
    def memory_usage(self) -> dict[str, int]: ...
    async def prewarm(self) -> None: ...
    async def kill(self) -> None: ...


V = TypeVar("V", bound=PooledVM)


class ForkPool(Generic[V]):
    """Waiting QEMU processes of type ``V``: whatever ``spawn`` makes."""

    def __init__(
        self,
        run_root: Path,
        *,
        spawn: Callable[..., Awaitable[V]],
        per_snapshot: int = 2,
        max_snapshots: int = 4,
        detach: bool = False,
        new_id: Callable[[], str] = new_vm_id,
        warm: bool = False,
        memory_cap_mib: int | None = None,
    ) -> None:
        """``spawn`` starts one waiting QEMU (:meth:`VM.spawn_incoming`'s signature);
        ``warm``: restore it too and stop it (hand it out with :meth:`VM.claim`).
        ``per_snapshot``: the most kept for one snapshot; ``memory_cap_mib``: the most
        host memory all pooled QEMUs may hold (None: no cap)."""
        self.run_root = run_root
        self.per_snapshot = per_snapshot
        self.max_snapshots = max_snapshots
        self.detach = detach
        self.new_id = new_id
        self.spawn = spawn
        self.warm = warm
        self.memory_cap_mib = memory_cap_mib
        self._demand: dict[Path, deque[tuple[float, int]]] = {}  # (when, children asked)
        self._ready: OrderedDict[Path, list[V]] = OrderedDict()
        self._fills: dict[Path, asyncio.Task[None]] = {}
        self._kills: set[asyncio.Task[None]] = set()  # keep references until done
        self._sizes: dict[str, int] = {}  # vm id -> private MiB, measured once

    def take(self, snapshot_dir: Path) -> V | None:
        """A waiting QEMU for ``snapshot_dir``, or None (then restore as usual)."""
        waiting = self._ready.get(snapshot_dir, [])
        while waiting:
            vm = waiting.pop(0)
            self._sizes.pop(vm.id, None)
            if vm.is_alive():
                return vm
            self._kill_later(vm)
        return None

    def record_demand(self, snapshot_dir: Path, children: int) -> None:
        """A fork request for ``children`` of ``snapshot_dir`` came (sizes its pool)."""
        now = time.monotonic()
        recent = self._demand.setdefault(snapshot_dir, deque())
        recent.append((now, children))
        while recent and now - recent[0][0] > DEMAND_WINDOW_SECS:
            recent.popleft()

    def target(self, snapshot_dir: Path) -> int:
        """How many should wait for ``snapshot_dir``: its recent peak demand, capped."""
        now = time.monotonic()
        recent = [n for t, n in self._demand.get(snapshot_dir, ()) if now - t <= DEMAND_WINDOW_SECS]
        return min(self.per_snapshot, max(recent, default=1))

    def _room_for_one(self) -> bool:
        """Whether one more pooled QEMU stays under the memory cap."""
        if self.memory_cap_mib is None:
            return True
        held = [self._size_mib(vm) for vm in self.all_vms()]
        each = max(held) if held else POOLED_VM_MIB_GUESS
        return sum(held) + each <= self.memory_cap_mib

    def refill(self, snapshot_dir: Path) -> None:
        """Top up ``snapshot_dir``'s waiting processes in the background."""
        if self.per_snapshot <= 0:
            return
        self._ready.setdefault(snapshot_dir, [])
        self._ready.move_to_end(snapshot_dir)
        while len(self._ready) > self.max_snapshots:
            old, vms = self._ready.popitem(last=False)
            self._cancel_fill(old)
            for vm in vms:
                self._kill_later(vm)
        task = self._fills.get(snapshot_dir)
        if task is None or task.done():
            self._fills[snapshot_dir] = asyncio.get_running_loop().create_task(
                self._fill(snapshot_dir), name=f"forkd-pool-fill-{snapshot_dir.name}"
            )

    def _kill_later(self, vm: V) -> None:
        self._sizes.pop(vm.id, None)
        task = asyncio.get_running_loop().create_task(vm.kill())
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def wait_filled(self, snapshot_dir: Path) -> None:
        task = self._fills.get(snapshot_dir)
        if task is not None:
            await asyncio.shield(task)

    async def _fill(self, snapshot_dir: Path) -> None:
        while snapshot_dir in self._ready and len(self._ready[snapshot_dir]) < self.target(
            snapshot_dir
        ):
            if not self._room_for_one():
                log.info(
                    "fork pool at its memory cap (%s MiB): not topping up %s",
                    self.memory_cap_mib,
                    snapshot_dir.name,
                )
                return
            try:
                vm = await self.spawn(
                    snapshot_dir, run_root=self.run_root, vm_id=self.new_id(), detach=self.detach
                )
                if self.warm:
                    await vm.prewarm()  # killed there if it fails
            except (ForkdError, OSError) as exc:
                log.warning("cannot pre-start a QEMU for %s: %s", snapshot_dir, exc)
                return
            if snapshot_dir in self._ready:
                self._ready[snapshot_dir].append(vm)
            else:  # dropped while we were starting it
                await vm.kill()

    def _cancel_fill(self, snapshot_dir: Path) -> None:
        task = self._fills.pop(snapshot_dir, None)
        if task is not None:
            task.cancel()

    async def drop(self, snapshot_dir: Path) -> None:
        """Kill the processes waiting for ``snapshot_dir`` (it is being deleted)."""
        task = self._fills.pop(snapshot_dir, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for vm in self._ready.pop(snapshot_dir, []):
            self._sizes.pop(vm.id, None)
            await vm.kill()

    async def close(self) -> None:
        for snapshot_dir in {*self._ready, *self._fills}:
            await self.drop(snapshot_dir)

    def _size_mib(self, vm: V) -> int:
        """A pooled VM's private memory, read once: a warm one is stopped and does
        not grow (a pre-started one barely does), and reading smaps of every pooled
        VM at each top-up would cost a large pool a second of CPU."""
        if vm.id not in self._sizes:
            self._sizes[vm.id] = vm.memory_usage().get("private", 0) >> 20
        return self._sizes[vm.id]

    def all_vms(self) -> list[V]:
        return [vm for vms in self._ready.values() for vm in vms]

    async def drop_using(self, volume: str) -> None:
        """Kill waiting processes whose snapshot attaches ``volume``."""
        for snapshot_dir, vms in list(self._ready.items()):
            if any(att.name == volume for vm in vms for att in vm.volumes):
                await self.drop(snapshot_dir)

    def filling(self) -> bool:
        """Whether QEMU processes are being started (their layers not yet listed)."""
        return any(not t.done() for t in self._fills.values())

    def waiting(self) -> int:
        return sum(len(v) for v in self._ready.values())
