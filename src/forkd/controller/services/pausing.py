"""Pause and resume: a sandbox's vCPUs stopped and started again, its memory kept;
or, with ``hibernate``, its state written to disk and its QEMU ended
(:mod:`.hibernation`).

A paused sandbox uses no CPU and answers no guest call (409 until it is
resumed); it can be branched as it is (no pause of its own, ``pause_ms`` 0)
and killed. Its state survives a daemon restart: a paused sandbox is adopted
paused. On resume the guest's clock, which stood still, is set again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from forkd.controller.services.activity import Activity
from forkd.controller.services.events import EventBus
from forkd.controller.services.hibernation import HibernateService, WakeService
from forkd.controller.services.holds import Holds
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.sandboxes import expiry_in
from forkd.controller.store import Store
from forkd.errors import Busy, Conflict, ForkdError, VMError
from forkd.states import SandboxState

log = logging.getLogger(__name__)


class PauseService:
    def __init__(
        self,
        store: Store,
        events: EventBus,
        holds: Holds,
        activity: Activity,
        records: Records,
        vms: LiveVMs,
        hibernation: HibernateService,
        waking: WakeService,
    ) -> None:
        self.store = store
        self.events = events
        self.holds = holds
        self.activity = activity
        self.records = records
        self.vms = vms
        self.hibernation = hibernation
        self.waking = waking

    async def pause(self, sandbox_id: str, hibernate: bool = False) -> None:
        """Stop the sandbox's vCPUs; :class:`Conflict` unless it is running. With
        ``hibernate``, a running or paused sandbox is written to disk and its QEMU ended."""
        if hibernate:
            async with self._lock(sandbox_id):
                await self.hibernation.hibernate(sandbox_id)  # its event with its state
            return
        async with self._lock(sandbox_id):
            vm = self._vm_in(sandbox_id, SandboxState.RUNNING, "already paused")
            try:
                await vm.pause()
            except ForkdError as exc:
                raise await self._failed(sandbox_id, vm, "pausing", exc) from exc
            with self.store.transaction():  # the event's outbox rows with the state change
                self.store.set_sandbox_state(sandbox_id, SandboxState.PAUSED)
                self.events.publish("paused", sandbox_id=sandbox_id)
            self.activity.count_pause(sandbox_id)

    async def resume(self, sandbox_id: str, timeout_s: float | None = None) -> None:
        """Run the paused sandbox again and set its clock, or wake the hibernated one;
        :class:`Conflict` unless it is paused or hibernated. ``timeout_s``: its new
        timeout from now (none: as it was; a woken one has none)."""
        async with self._lock(sandbox_id):
            woke = self.records.sandbox_row(sandbox_id).state == SandboxState.HIBERNATED

            def announce() -> None:  # in the transaction of the state change
                if timeout_s is not None:
                    self.store.update_sandbox(sandbox_id, expires_at_unix=expiry_in(timeout_s))
                self.events.publish("resumed", sandbox_id=sandbox_id, woken=woke)

            if woke:
                await self.waking.wake(sandbox_id, announce)
            else:
                await self._resume_paused(sandbox_id, announce)

    async def resume_for_request(self, sandbox_id: str) -> str | None:
        """Resume or wake the sandbox a request needs running (:mod:`.waking`): the state
        it woke from, or None when it ran already (another request woke it)."""
        started = time.monotonic()
        async with self._lock(sandbox_id):
            was = self.records.sandbox_row(sandbox_id).state
            woken = was == SandboxState.HIBERNATED

            def announce() -> None:  # in the transaction of the state change
                ms = round((time.monotonic() - started) * 1000, 1)
                self.events.publish(
                    "resumed", sandbox_id=sandbox_id, woken=woken, reason="request", wake_ms=ms
                )

            if was == SandboxState.HIBERNATED:
                await self.waking.wake(sandbox_id, announce)
            elif was == SandboxState.PAUSED:
                await self._resume_paused(sandbox_id, announce)
            else:
                return None
        ms = round((time.monotonic() - started) * 1000, 1)
        self.activity.count_wake(sandbox_id)
        log.info("sandbox %s woke from %s for a request in %.0f ms", sandbox_id, was, ms)
        return str(was)

    async def _resume_paused(self, sandbox_id: str, announce: Callable[[], None]) -> None:
        vm = self._vm_in(sandbox_id, SandboxState.PAUSED, "not paused")
        try:
            await vm.resume()
        except ForkdError as exc:
            raise await self._failed(sandbox_id, vm, "resuming", exc) from exc
        with self.store.transaction():
            self.store.set_sandbox_state(sandbox_id, SandboxState.RUNNING)
            announce()
        try:
            await vm.guest.after_resume()
        except ForkdError as exc:  # it runs; only its clock may lag
            log.warning("sandbox %s resumed, but its clock was not set: %s", sandbox_id, exc)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        """The sandbox's branch lock: a branch in flight resumes what it paused."""
        self.records.sandbox_row(sandbox_id)  # 404 before anything is made for it
        return self.holds.sandbox_lock(sandbox_id)

    def _vm_in(self, sandbox_id: str, state: SandboxState, otherwise: str) -> SandboxVM:
        vm = self.vms.live(sandbox_id, paused_ok=True)
        if self.records.sandbox_row(sandbox_id).state != state:
            raise Conflict(f"sandbox {sandbox_id!r} is {otherwise}")
        return vm

    async def _failed(
        self, sandbox_id: str, vm: SandboxVM, doing: str, exc: ForkdError
    ) -> ForkdError:
        if isinstance(exc, Busy):  # an upload still crossing the agent channel: retry
            return exc
        if not vm.is_alive():
            await self.vms.mark_dead(sandbox_id)
            return Conflict(f"sandbox {sandbox_id!r} died while {doing}: {exc}")
        return VMError(f"{doing} sandbox {sandbox_id!r} failed: {exc}")
