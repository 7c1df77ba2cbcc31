"""Wake on demand: a request that needs a paused or hibernated sandbox running
resumes it first, then is answered, as E2B's auto-resume does; a sandbox made
with ``auto_resume: false`` answers 409 instead, as before.

Every route that talks to the guest (exec, eval, files, processes, terminals,
diffs, the port proxy and preview URLs) reaches it through
:meth:`Waker.running`. Concurrent requests share one resume, and a resume that fails
is each one's failure, with the same error. A followed output stream does not
wake its sandbox: it waits, as it did, for someone to resume it.

What the wake cost is the answer's ``Forkd-Wake-Ms`` header
(:class:`forkd.controller.middleware.SandboxRequests`, from :func:`request_waits`),
the ``resumed`` event's ``wake_ms`` and ``reason: "request"``, and the metrics
``forkd_wakes_total{from}`` and ``forkd_wake_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from forkd import tracing
from forkd.controller.services.periodic import finish_or_cancel
from forkd.states import SandboxState

if TYPE_CHECKING:
    from forkd.controller.services.holds import Holds
    from forkd.controller.services.live_vms import LiveVMs
    from forkd.controller.services.records import Records
    from forkd.controller.services.sandbox_vm import SandboxVM

# The request being answered: the wakes it waited for, in ms (None outside a request).
_WAITED: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar(
    "forkd_wake_waited", default=None
)


@contextlib.contextmanager
def request_waits() -> Iterator[list[float]]:
    """For the block (one request): the ms of each wake it waited for, as they end."""
    waited: list[float] = []
    token = _WAITED.set(waited)
    try:
        yield waited
    finally:
        _WAITED.reset(token)


Resume = Callable[[str], Awaitable[str | None]]  # the state it woke from; None: it ran
Observe = Callable[[str, float], None]  # (the state it woke from, seconds)


class Waker:
    """One resume at a time per sandbox, shared by every request that waits for it.

    ``resume(sandbox_id)`` runs the sandbox again if it is paused or hibernated
    (under its lock) and says which it was; ``observe`` counts a wake in the metrics.
    """

    def __init__(
        self,
        holds: Holds,
        records: Records,
        vms: LiveVMs,
        resume: Resume,
        observe: Observe | None = None,
    ) -> None:
        self.holds = holds
        self.records = records
        self.vms = vms
        self._resume = resume
        self._observe = observe
        self._waking: dict[str, asyncio.Future[float]] = {}

    async def running(self, sandbox_id: str) -> SandboxVM:
        """The running VM of ``sandbox_id`` for a request: a paused or hibernated sandbox
        is woken first unless it was made with ``auto_resume`` false; then as
        :meth:`LiveVMs.live <forkd.controller.services.live_vms.LiveVMs.live>`."""
        row = self.records.sandbox_row(sandbox_id)
        evicting = self.holds.evicting.get(sandbox_id)
        if evicting is not None:  # reclaim is hibernating it: then wake it
            await evicting.wait()
            row = self.records.sandbox_row(sandbox_id)
        if row.state in (SandboxState.PAUSED, SandboxState.HIBERNATED) and row.auto_resume:
            await self(sandbox_id)
        return self.vms.live(sandbox_id)

    async def __call__(self, sandbox_id: str) -> float:
        """Wake the sandbox (or wait for the wake already under way); the ms it took."""
        shared = self._waking.get(sandbox_id)
        if shared is None:
            shared = asyncio.ensure_future(self._wake(sandbox_id))
            self._waking[sandbox_id] = shared
            self.holds.want(sandbox_id)  # until _done
            shared.add_done_callback(lambda done: self._done(sandbox_id, done))
        # A waiter that leaves (its client gone) does not cancel the others' wake.
        ms = await asyncio.shield(shared)
        waited = _WAITED.get()
        if waited is not None:
            waited.append(ms)
        return ms

    def waking(self, sandbox_id: str) -> bool:
        return sandbox_id in self._waking

    async def drain(self, timeout: float) -> None:
        """Let the wakes under way end (the daemon stops): a wake shielded from its
        waiters would otherwise outlive the registry it adds its QEMU to. Past
        ``timeout`` they are cancelled: the restore leaves the sandbox hibernated."""
        await finish_or_cancel(self._waking.values(), timeout)

    async def _wake(self, sandbox_id: str) -> float:
        started = time.monotonic()
        with tracing.span("wake", sandbox_id=sandbox_id):
            was = await self._resume(sandbox_id)
        secs = time.monotonic() - started
        if was is not None and self._observe is not None:
            self._observe(was, secs)
        return round(secs * 1000, 1)

    def _done(self, sandbox_id: str, done: asyncio.Future[float]) -> None:
        if self._waking.get(sandbox_id) is done:
            del self._waking[sandbox_id]
            self.holds.unwant(sandbox_id)
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have gone
