"""What each sandbox uses: ``GET /v1/sandboxes/:id/metrics``, the host-wide list behind
``forkd top`` and the console, and the per-sandbox Prometheus series.

Two sources. The host's own reading of a sandbox's QEMU (its CPU time from
``/proc/PID/stat``, its own memory from ``/proc/PID/status``, its PSS from
``smaps_rollup``) is cheap and trusted. The guest's word (its memory in use, disk,
network bytes and processes: the agent's ``stats`` op, forkd_stats.py) costs a call
into the guest, so it is asked for one sandbox on demand, or, for the list and the
Prometheus series, kept from the last reading and refreshed in the background only
while someone is watching (a scrape or a list in the last ``WATCHED_SECS``). The
guest's answer is hostile input: checked against :class:`GuestStats`, and dropped
(null figures) when it does not fit.

Reading metrics is not use: it neither wakes a sleeping sandbox nor resets its
idle clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forkd.controller.models import (
    CpuUsage,
    MemoryUsage,
    NetworkUsage,
    SandboxMetrics,
    SpaceUsage,
    VolumeUsage,
)
from forkd.controller.services.activity import Activity
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.periodic import Periodic
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.sandboxes import iso_time
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.errors import ForkdError, NotFound
from forkd.states import SandboxState

log = logging.getLogger(__name__)

GUEST_STATS_SECS = 3.0  # one guest's answer
CPU_WINDOW_SECS = 1.0  # the least time a CPU percent is measured over
WATCHED_SECS = 120.0  # after a scrape or a list: keep the guests' figures fresh this long
REFRESH_SECS = 15.0  # how old a kept guest reading may get while watched

Count = Annotated[int, Field(ge=0, le=1 << 62)]


class _Space(BaseModel):
    model_config = ConfigDict(extra="ignore")
    total_bytes: Count
    used_bytes: Count


class _GuestCpu(BaseModel):
    model_config = ConfigDict(extra="ignore")
    count: Annotated[int, Field(ge=1, le=4096)]


class _GuestNetwork(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rx_bytes: Count
    tx_bytes: Count


class GuestStats(BaseModel):
    """What the host accepts of a guest's ``stats`` answer."""

    model_config = ConfigDict(extra="ignore")
    cpu: _GuestCpu
    memory: _Space
    disk: _Space | None
    mounts: Annotated[dict[str, _Space | None], Field(max_length=64)]
    network: _GuestNetwork
    processes: Count


class UsageService:
    def __init__(
        self,
        store: Store,
        activity: Activity,
        vms: LiveVMs,
    ) -> None:
        self.store = store
        self.activity = activity
        self.vms = vms
        # Per sandbox: (monotonic, CPU seconds, percent) of the last CPU reading.
        self._cpu: dict[str, tuple[float, float, float]] = {}
        self._guest: dict[str, tuple[float, GuestStats]] = {}  # the last guest reading
        self._watched_until = 0.0
        self._loop = Periodic("usage", REFRESH_SECS / 3, self._refresh_if_watched)

    # ------------------------------------------------------------ one sandbox

    async def of(self, sandbox_id: str) -> SandboxMetrics:
        """What the sandbox uses now; its guest is asked when it runs."""
        self._forget_gone()
        row = self._row(sandbox_id)
        vm = self._vm(row)
        if vm is not None and row.state == SandboxState.RUNNING:
            await self._read_guest(sandbox_id, vm)
        metrics = self._metrics(row, vm)
        if vm is not None:
            with contextlib.suppress(OSError):  # its QEMU just exited
                usage = await asyncio.to_thread(vm.memory_usage)
                metrics.memory.host_proportional_bytes = usage.get("pss")
        return metrics

    # ------------------------------------------------------------ all of them

    def all(self) -> list[SandboxMetrics]:
        """Every sandbox's host figures now, and its guest's as last read (no guest is
        asked here; being asked for them keeps them fresh for a while)."""
        self._watched_until = time.monotonic() + WATCHED_SECS
        rows = self.store.list_sandboxes()
        self._forget_gone()
        return [self._metrics(row, self._vm(row)) for row in rows]

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _refresh_if_watched(self) -> None:
        if time.monotonic() <= self._watched_until:
            await self.refresh()

    async def refresh(self) -> None:
        """Ask each running guest whose figures are older than REFRESH_SECS, in turn."""
        now = time.monotonic()
        self._forget_gone()
        for row in self.store.list_sandboxes():
            vm = self._vm(row)
            kept = self._guest.get(row.id)
            if (
                vm is None
                or row.state != SandboxState.RUNNING
                or (kept and now - kept[0] < REFRESH_SECS)
            ):
                continue
            await self._read_guest(row.id, vm)

    # ------------------------------------------------------------ readings

    def _row(self, sandbox_id: str) -> SandboxRow:
        row = self.store.get_sandbox(sandbox_id)  # not sandbox_row: this is no use
        if row is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        return row

    def _vm(self, row: SandboxRow) -> SandboxVM | None:
        return (
            self.vms.get(row.id)
            if row.state in (SandboxState.RUNNING, SandboxState.PAUSED)
            else None
        )

    async def _read_guest(self, sandbox_id: str, vm: SandboxVM) -> None:
        paths = [v.path for v in vm.volumes]
        try:
            said = await asyncio.wait_for(vm.guest.stats(paths), GUEST_STATS_SECS)
            stats = GuestStats.model_validate(said)
        except (ForkdError, TimeoutError, ValidationError) as exc:
            log.debug("sandbox %s: no guest figures: %s", sandbox_id, exc)
            self._guest.pop(sandbox_id, None)
            return
        # Only the mount points asked about are kept, not whatever else it named.
        stats.mounts = {p: stats.mounts[p] for p in paths if p in stats.mounts}
        self._guest[sandbox_id] = (time.monotonic(), stats)

    def _metrics(self, row: SandboxRow, vm: SandboxVM | None) -> SandboxMetrics:
        activity = self.activity
        metrics = SandboxMetrics(
            sandbox_id=row.id,
            state=row.state,
            timestamp=iso_time(time.time()),
            cpu=CpuUsage(),
            memory=MemoryUsage(),
            last_active_at=iso_time(activity.last_active(row.id)),
            wakes=activity.wakes(row.id),
            evictions=activity.evictions(row.id),
        )
        if vm is not None:
            self._host(row.id, vm, metrics)
        kept = self._guest.get(row.id)
        if kept is not None and row.state in (SandboxState.RUNNING, SandboxState.PAUSED):
            _guest_figures(kept[1], vm, metrics)
        return metrics

    def _host(self, sandbox_id: str, vm: SandboxVM, metrics: SandboxMetrics) -> None:
        try:
            cpu_s, age_s = vm.cpu_times()
            own = vm.resident_memory().get("anon")
        except OSError:  # its QEMU just exited: the reaper marks it dead
            return
        metrics.cpu.seconds = round(cpu_s, 2)
        metrics.cpu.percent = self._cpu_percent(sandbox_id, cpu_s, age_s)
        metrics.memory.host_private_bytes = own

    def _cpu_percent(self, sandbox_id: str, cpu_s: float, age_s: float) -> float:
        """Of one core, over the time since the reading before (at least CPU_WINDOW_SECS
        ago), or since its QEMU started."""
        now = time.monotonic()
        last = self._cpu.get(sandbox_id)
        if last is not None and now - last[0] < CPU_WINDOW_SECS:
            return last[2]
        if last is None or cpu_s < last[1]:  # first seen, or a new QEMU (woken)
            percent = 100 * cpu_s / age_s if age_s > 0 else 0.0
        else:
            percent = 100 * (cpu_s - last[1]) / (now - last[0])
        percent = round(percent, 1)
        self._cpu[sandbox_id] = (now, cpu_s, percent)
        return percent

    def _forget_gone(self) -> None:
        """Drop the readings of sandboxes with no VM now (deleted, dead, hibernated)."""
        ids = self.vms.keys()
        for gone in self._cpu.keys() - ids:
            del self._cpu[gone]
        for gone in self._guest.keys() - ids:
            del self._guest[gone]


def _guest_figures(stats: GuestStats, vm: SandboxVM | None, metrics: SandboxMetrics) -> None:
    metrics.cpu.count = stats.cpu.count
    metrics.memory.guest_total_bytes = stats.memory.total_bytes
    metrics.memory.guest_used_bytes = min(stats.memory.used_bytes, stats.memory.total_bytes)
    if stats.disk is not None:
        metrics.disk = SpaceUsage(**stats.disk.model_dump())
    metrics.network = NetworkUsage(**stats.network.model_dump())
    metrics.processes = stats.processes
    for volume in vm.volumes if vm is not None else ():
        space = stats.mounts.get(volume.path)
        if space is not None:
            metrics.volumes.append(
                VolumeUsage(name=volume.name, path=volume.path, **space.model_dump())
            )
