"""A pass run every so often in a task of its own, for the daemon's background work
(reclaim, refreshing the guests' figures): a pass that fails is logged and the next
one runs; stopping cancels the task and waits for it. And :func:`finish_or_cancel`,
for work shielded from its callers that the daemon's stop must still end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


async def finish_or_cancel(tasks: Iterable[asyncio.Future[Any]], timeout: float) -> None:
    """Let ``tasks`` end within ``timeout``; those that have not are cancelled, and waited
    for until they have ended."""
    pending = set(tasks)
    if not pending:
        return
    _, late = await asyncio.wait(pending, timeout=timeout)
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late)


class Periodic:
    def __init__(self, name: str, interval_s: float, run: Callable[[], Awaitable[object]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._run = run
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"forkd-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._run()
            except Exception:  # keep going whatever one pass hit
                log.exception("%s: a pass failed", self.name)
