"""When each sandbox was last used, for idle timeouts and reclaim, which requests use
it now, and how often it was paused, for the guest calls a pause interrupted."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator

from forkd.controller.store_rows import SandboxRow
from forkd.states import SandboxState

# The request being answered: the sandboxes it uses, each with what ends that use
# (None outside a request).
_ENDING: contextvars.ContextVar[dict[str, Callable[[], None]] | None] = contextvars.ContextVar(
    "forkd_request_ending", default=None
)


@contextlib.contextmanager
def request_scope() -> Iterator[None]:
    """For the block (one request, its stream or WebSocket included): the sandboxes it
    touches count as in use until it ends (:meth:`Activity.touch`)."""
    ending: dict[str, Callable[[], None]] = {}
    token = _ENDING.set(ending)
    try:
        yield
    finally:
        _ENDING.reset(token)
        for end in ending.values():
            end()


MAX_LISTED = 4096  # processes in one guest's list (its agent keeps 128 commands)
MAX_OUTPUT_END = 1 << 62


def output_total(listed: object) -> int | None:
    """The bytes a guest's processes wrote in all, from its ``proc_list`` answer (hostile
    input); None when that is not a list of processes with counts."""
    if not isinstance(listed, list) or len(listed) > MAX_LISTED:
        return None
    total = 0
    for proc in listed:
        if not isinstance(proc, dict):
            return None
        end = proc.get("output_end")
        if end is None:  # an agent older than output_end
            continue
        if type(end) is not int or not 0 <= end <= MAX_OUTPUT_END:
            return None
        total += end
    return total


class Activity:
    def __init__(self) -> None:
        # When each sandbox was last touched by an API call or seen writing output,
        # and how much output its processes had written then.
        self._last: dict[str, float] = {}
        self._output_seen: dict[str, int] = {}
        # How many times each sandbox was paused: a call that failed across a pause
        # is retried.
        self._pauses: dict[str, int] = {}
        # Requests using each sandbox now (an exec, a followed stream, a terminal).
        self._using: dict[str, int] = {}
        # Each sandbox's wakes by a request and evictions under memory pressure.
        self._wakes: dict[str, int] = {}
        self._evictions: dict[str, int] = {}

    def touch(self, sandbox_id: str) -> None:
        """Something used the sandbox now: its idle timeout counts from here. Inside a
        :func:`request_scope`, the sandbox is in use until that request ends, and its
        idle clock starts again then."""
        self._last[sandbox_id] = time.time()
        ending = _ENDING.get()
        if ending is None or sandbox_id in ending:
            return
        self._using[sandbox_id] = self._using.get(sandbox_id, 0) + 1
        ending[sandbox_id] = functools.partial(self._release, sandbox_id)

    def in_use(self, sandbox_id: str) -> bool:
        """Whether a request is using the sandbox now."""
        return self._using.get(sandbox_id, 0) > 0

    def _release(self, sandbox_id: str) -> None:
        left = self._using.get(sandbox_id, 0) - 1
        if left > 0:
            self._using[sandbox_id] = left
        else:
            self._using.pop(sandbox_id, None)
        if sandbox_id in self._last:  # not one forgotten meanwhile (a DELETE's own)
            self._last[sandbox_id] = time.time()

    def last_active(self, sandbox_id: str) -> float | None:
        return self._last.get(sandbox_id)

    def idle_since(self, row: SandboxRow) -> float:
        """When the sandbox was last active (a daemon's start counts as activity)."""
        return self._last.setdefault(row.id, time.time())

    def idle_expired(self, row: SandboxRow) -> bool:
        """Whether the running sandbox has been idle past its idle timeout (no request
        open on it, none in that long)."""
        if row.idle_timeout_s is None or row.state != SandboxState.RUNNING:
            return False
        if self.in_use(row.id):  # a request open on it (a stream, a terminal) is use
            return False
        return time.time() - self.idle_since(row) >= row.idle_timeout_s

    def output_written(self, sandbox_id: str, listed: object) -> bool:
        """Whether its processes (``listed``: the guest's ``proc_list`` answer) have
        written more than when last asked; that counts as activity. An answer that is
        not a list of processes with byte counts shows nothing: a guest cannot keep
        itself busy, out of reclaim and its idle timeout, by answering nonsense."""
        written = output_total(listed)
        if written is None or self._output_seen.get(sandbox_id, 0) == written:
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

    def count_wake(self, sandbox_id: str) -> None:
        """A request woke the sandbox (:mod:`.waking`)."""
        self._wakes[sandbox_id] = self._wakes.get(sandbox_id, 0) + 1

    def wakes(self, sandbox_id: str) -> int:
        return self._wakes.get(sandbox_id, 0)

    def count_eviction(self, sandbox_id: str) -> None:
        """Reclaim hibernated the sandbox (:mod:`.reclaim`)."""
        self._evictions[sandbox_id] = self._evictions.get(sandbox_id, 0) + 1

    def evictions(self, sandbox_id: str) -> int:
        return self._evictions.get(sandbox_id, 0)

    def forget_counts(self, sandbox_id: str) -> None:
        """The sandbox is deleted: its wakes and evictions go too."""
        self._wakes.pop(sandbox_id, None)
        self._evictions.pop(sandbox_id, None)
