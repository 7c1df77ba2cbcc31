"""Reclaim under memory pressure: idle sandboxes are hibernated to give their memory
back, the way ``pause --hibernate`` does, and wake on their next request.

Every ``RECLAIM_INTERVAL_SECS`` the reclaimer reads the host's available memory; below
the low watermark (``--reclaim-low``) it hibernates idle sandboxes, one at a time, until
the high watermark (``--reclaim-high``) is available again or none is left to take. A
fork that would not fit (admission's real-memory check) first asks it to free what it
lacks (:meth:`Reclaimer.make_room`).

A sandbox may be taken when it is ``evictable`` (the default; ``false`` protects it),
running with ``auto_resume`` (a request wakes it again) or paused, and idle: no request
using it now (an exec, a followed stream, a terminal, a transfer), none for
``--reclaim-idle`` seconds, and no output from its processes since the last look.
Paused ones go first, then the least recently used. Nothing is ever killed to make
room: when reclaim cannot free enough, admission refuses new sandboxes (429). Nor is
the disk filled to make it: a sandbox is hibernated only when the snapshot disk holds
its whole memory besides ``--disk-reserve`` (:mod:`.disk_room`); one that does not
fit is skipped, and the 429 says so.

Each eviction is a ``hibernated`` event with ``reason: "memory_pressure"``, an audit record and
``forkd_evictions_total``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

from forkd.controller.services.activity import Activity
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernation import HibernateService
from forkd.controller.services.holds import Holds
from forkd.controller.services.host_memory import MemoryWatch
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.periodic import Periodic, finish_or_cancel
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.errors import ForkdError, StorageFull
from forkd.states import SandboxState

log = logging.getLogger(__name__)

RECLAIM_INTERVAL_SECS = 2.0
OUTPUT_CHECK_SECS = 3.0  # asking a guest what its processes wrote
SAY_SHORT_SECS = 60.0  # "nothing left to take" is logged at most this often
STOP_SECS = 30.0  # a pass under way when the daemon stops: this long to end
EVICTED_REASON = "memory_pressure"  # the hibernated event's reason when reclaim evicted it

AuditWriter = Callable[..., None]


class Reclaimer:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        events: EventBus,
        holds: Holds,
        activity: Activity,
        memory: MemoryWatch,
        vms: LiveVMs,
        hibernation: HibernateService,
        observe: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.events = events
        self.holds = holds
        self.activity = activity
        self.memory = memory
        self.vms = vms
        self.hibernation = hibernation
        self._observe = observe  # counts one eviction in the metrics
        self.audit: AuditWriter | None = None  # set by the app once its audit log is open
        self._lock = asyncio.Lock()  # one pass at a time: the loop's or a fork's
        self._disk_short: str | None = None  # why the last pass skipped some for disk
        self._said_short_at = -SAY_SHORT_SECS
        self._passes: set[asyncio.Task[list[str]]] = set()  # under way or waiting
        self._loop = Periodic("reclaim", RECLAIM_INTERVAL_SECS, self.reclaim_once)

    @property
    def enabled(self) -> bool:
        return self.settings.reclaim_low_mib is not None

    # ------------------------------------------------------------------ loop

    def start(self) -> None:
        if self.enabled:
            self._loop.start()

    async def stop(self) -> None:
        """Stop looking; a hibernation under way ends first (it is shielded from the
        caller that asked for it), within STOP_SECS, else it is cancelled."""
        await self._loop.stop()
        await finish_or_cancel(self._passes, STOP_SECS)

    async def reclaim_once(self) -> list[str]:
        """One look: below the low watermark, hibernate idle sandboxes until the high one
        is available. The ids hibernated."""
        settings = self.settings
        if settings.reclaim_low_mib is None or settings.reclaim_high_mib is None:
            return []
        available = self._available()
        if available >= settings.reclaim_low_mib:
            return []
        return await self._free_until(settings.reclaim_high_mib, "low watermark")

    async def make_room(self, mib: int) -> list[str]:
        """Hibernate idle sandboxes until ``mib`` more than now is available (a fork's
        shortfall). The ids hibernated; none when reclaim is off."""
        if not self.enabled or mib <= 0:
            return []
        return await self._free_until(self._available() + mib, "a new sandbox")

    # ------------------------------------------------------------- choosing

    def candidates(self) -> list[SandboxRow]:
        """Sandboxes reclaim may take now, in the order it takes them: paused first,
        then the least recently used. Their processes' output is checked later."""
        idle_s = self.settings.reclaim_idle_s
        now = time.time()
        rows = [
            row
            for row in self.store.list_sandboxes()
            if row.id in self.vms
            and self._idle(row, now, idle_s)
            and not self.holds.sandbox_busy(row.id)  # a branch, pause or resume has it
        ]
        rows.sort(key=lambda r: (r.state != SandboxState.PAUSED, self.activity.idle_since(r)))
        return rows

    def _idle(self, row: SandboxRow, now: float, idle_s: float) -> bool:
        activity = self.activity
        return (
            row.evictable
            and (
                row.state == SandboxState.PAUSED
                or (row.state == SandboxState.RUNNING and row.auto_resume)
            )
            and not activity.in_use(row.id)
            and now - activity.idle_since(row) >= idle_s
            and not self.holds.is_wanted(row.id)
        )

    def busy_summary(self) -> str:
        """Why reclaim has nothing to take: for the 429 that admission gives then."""
        if not self.enabled:
            return "reclaim is off (--reclaim-low 0)"
        rows = [r for r in self.store.list_sandboxes() if r.id in self.vms]
        protected = sum(1 for r in rows if not r.evictable)
        now, idle_s = time.time(), self.settings.reclaim_idle_s
        idle = sum(1 for r in rows if self._idle(r, now, idle_s))
        summary = (
            f"reclaim found {idle} idle sandboxes to hibernate of {len(rows)} with a VM "
            f"({protected} not evictable; the rest used in the last {idle_s:g} s "
            "(--reclaim-idle) or busy)"
        )
        if self._disk_short is not None:
            summary += f"; some were skipped for disk: {self._disk_short}"
        return summary

    async def _quiet(self, row: SandboxRow) -> bool:
        """Whether its processes wrote nothing since the last look (a paused one's
        cannot). Output counts as use: its idle clock starts again."""
        if row.state == SandboxState.PAUSED:
            return True
        vm = self.vms.get(row.id)
        if vm is None:
            return False
        # Bounded: a guest that does not answer must not cost every pass a long wait.
        return await self.vms.wrote_nothing(row.id, vm, OUTPUT_CHECK_SECS)

    # ------------------------------------------------------------- evicting

    async def _free_until(self, target_mib: int, why: str) -> list[str]:
        # A fresh context: the evictions are no request's use of those sandboxes.
        task = asyncio.create_task(self._free(target_mib, why), context=contextvars.Context())
        self._passes.add(task)
        task.add_done_callback(self._passes.discard)
        return await asyncio.shield(task)

    async def _free(self, target_mib: int, why: str) -> list[str]:
        taken: list[str] = []
        async with self._lock:
            tried: set[str] = set()
            disk_short: str | None = None
            while self._available() < target_mib:
                row = next((r for r in self.candidates() if r.id not in tried), None)
                if row is None:
                    self._say_short(target_mib, why)
                    break
                tried.add(row.id)
                try:
                    self._check_disk(row)
                except StorageFull as exc:  # a smaller one may still fit
                    disk_short = str(exc)
                    continue
                try:
                    if await self._quiet(row) and await self._evict(row, why):
                        taken.append(row.id)
                except Exception:  # one sandbox's trouble must not end the pass
                    log.exception("reclaim: sandbox %s could not be taken", row.id)
            if disk_short is not None and self._disk_short is None:
                log.warning("reclaim skips sandboxes until the disk has room: %s", disk_short)
            self._disk_short = disk_short
        return taken

    def _say_short(self, target_mib: int, why: str) -> None:
        """Log that nothing is left to take: once a minute, not every pass."""
        now = time.monotonic()
        if now - self._said_short_at < SAY_SHORT_SECS:
            return
        self._said_short_at = now
        log.warning(
            "reclaim: %d MiB available, %d wanted (%s); %s",
            self._available(),
            target_mib,
            why,
            self.busy_summary(),
        )

    def _check_disk(self, row: SandboxRow) -> None:
        vm = self.vms.get(row.id)
        if vm is not None:
            self.hibernation.check_disk(row.id, also_mib=vm.machine.memory_mib)

    async def _evict(self, row: SandboxRow, why: str) -> bool:
        available = self._available()
        try:
            evicted = await self.evict(row.id, self._still_idle, available_mib=available)
        except ForkdError as exc:
            log.warning("reclaim: hibernating sandbox %s failed: %s", row.id, exc)
            return False
        if not evicted:
            return False
        after = self._available()
        freed = after - available
        log.info(
            "reclaim: hibernated idle sandbox %s (%s): %d MiB available, %+d MiB",
            row.id,
            why,
            after,
            freed,
        )
        self.activity.count_eviction(row.id)
        fields: dict[str, Any] = {"available_mib": available, "freed_mib": freed}
        if self._observe is not None:
            self._observe()
        if self.audit is not None:
            self.audit(event="evicted", sandbox=row.id, reason=EVICTED_REASON, **fields)
        return True

    async def evict(
        self, sandbox_id: str, idle: Callable[[SandboxRow], bool], available_mib: int = 0
    ) -> bool:
        """Hibernate the sandbox if ``idle(row)`` still holds once its lock is taken;
        whether it was. A request that comes meanwhile waits for the hibernation to
        end, then wakes it (:meth:`.waking.Waker.running`). Its ``hibernated`` event
        says ``memory_pressure`` and the ``available_mib`` that made reclaim act."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None or not idle(row):
            return False
        done = self.holds.evicting[sandbox_id] = asyncio.Event()
        try:
            async with self.holds.sandbox_lock(sandbox_id):
                row = self.store.get_sandbox(sandbox_id)
                if (
                    row is None
                    or row.state not in (SandboxState.RUNNING, SandboxState.PAUSED)
                    or not idle(row)
                ):
                    return False
                await self.hibernation.hibernate(
                    sandbox_id,
                    keep_timeout=True,
                    reason=EVICTED_REASON,
                    available_mib=available_mib,
                )
            return True
        finally:
            del self.holds.evicting[sandbox_id]
            done.set()

    def _still_idle(self, row: SandboxRow) -> bool:
        """Checked again under the sandbox's lock, just before it is hibernated."""
        return self._idle(row, time.time(), self.settings.reclaim_idle_s)

    def _available(self) -> int:
        return self.memory.host().available_mib
