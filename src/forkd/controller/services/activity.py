"""When each sandbox was last used, for idle timeouts, and how often it was paused,
for the guest calls a pause interrupted."""

from __future__ import annotations

import time

from forkd.controller.store import SandboxRow
from forkd.states import SandboxState


class Activity:
    def __init__(self) -> None:
        # When each sandbox was last touched by an API call or seen writing output,
        # and how much output its processes had written then.
        self._last: dict[str, float] = {}
        self._output_seen: dict[str, int] = {}
        # How many times each sandbox was paused: a call that failed across a pause
        # is retried.
        self._pauses: dict[str, int] = {}

    def touch(self, sandbox_id: str) -> None:
        """Something used the sandbox now: its idle timeout counts from here."""
        self._last[sandbox_id] = time.time()

    def last_active(self, sandbox_id: str) -> float | None:
        return self._last.get(sandbox_id)

    def idle_since(self, row: SandboxRow) -> float:
        """When the sandbox was last active (a daemon's start counts as activity)."""
        return self._last.setdefault(row.id, time.time())

    def idle_expired(self, row: SandboxRow) -> bool:
        """Whether the running sandbox has been idle past its idle timeout."""
        if row.idle_timeout_s is None or row.state != SandboxState.RUNNING:
            return False
        return time.time() - self.idle_since(row) >= row.idle_timeout_s

    def output_written(self, sandbox_id: str, written: int) -> bool:
        """Its processes have written ``written`` bytes in all: whether that is more
        than when last asked (then it counts as activity)."""
        if self._output_seen.get(sandbox_id, 0) == written:
            return False
        self._output_seen[sandbox_id] = written
        self.touch(sandbox_id)
        return True

    def count_pause(self, sandbox_id: str) -> None:
        """The sandbox's vCPUs were just stopped: a guest call that failed across this
        pause is retried (see :meth:`pauses`)."""
        self._pauses[sandbox_id] = self._pauses.get(sandbox_id, 0) + 1

    def pauses(self, sandbox_id: str) -> int:
        return self._pauses.get(sandbox_id, 0)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox's VM is gone."""
        self._pauses.pop(sandbox_id, None)
        self._last.pop(sandbox_id, None)
        self._output_seen.pop(sandbox_id, None)
