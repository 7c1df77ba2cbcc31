"""What one request holds that another must wait for or be refused by.

Each hold is a named context manager taken for exactly as long as the work that
needs it, and a question another service asks (``base_in_use``, ``is_waking``…).
No service counts another's work: they all ask here. Everything is in-memory
and single-threaded (the event loop): a check and the hold it guards run with
no await between them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator

from forkd.errors import Conflict


class Holds:
    def __init__(self) -> None:
        self._tags: set[str] = set()  # snapshots being created under these tags
        # One branch (or pause, resume, hibernation) of a sandbox at a time. A branch
        # holds its lock object itself; the entry goes once the sandbox is gone.
        self._sandbox_locks: dict[str, asyncio.Lock] = {}
        self._bases: collections.Counter[str] = collections.Counter()  # diff branches over
        self._read: collections.Counter[str] = collections.Counter()  # pushes reading whole
        self._deleting: set[str] = set()  # snapshots a delete checked and is removing
        self._hibernated_readers: dict[str, list[asyncio.Event]] = {}
        self._volume_layer_ops = 0  # starts holding volume layers no registry names yet
        self._waking: set[str] = set()  # hibernated sandboxes being restored
        self._wanted: set[str] = set()  # paused or hibernated sandboxes a request wakes
        # Sandboxes reclaim is hibernating now: each event is set once that one is.
        self.evicting: dict[str, asyncio.Event] = {}

    # ------------------------------------------------------------ snapshots

    @contextlib.contextmanager
    def new_tag(self, tag: str) -> Iterator[str]:
        """``tag`` held for a snapshot being created; :class:`Conflict` if it already is."""
        if tag in self._tags:
            raise Conflict(f"a snapshot named {tag!r} is being created")
        self._tags.add(tag)
        try:
            yield tag
        finally:
            self._tags.discard(tag)

    @contextlib.contextmanager
    def diff_base(self, tag: str | None) -> Iterator[None]:
        """A diff branch over snapshot ``tag`` is being written: it is not deleted."""
        if tag is not None:
            self._bases[tag] += 1
        try:
            yield
        finally:
            if tag is not None:
                self._bases[tag] -= 1
                if not self._bases[tag]:
                    del self._bases[tag]

    def base_in_use(self, tag: str) -> bool:
        return self._bases[tag] > 0

    def hold_reading(self, tag: str) -> Callable[[], None]:
        """Snapshot ``tag`` is being read whole (a push): it is not deleted until the
        function returned is called (once; later calls do nothing). :class:`Conflict`
        when it is being deleted."""
        if tag in self._deleting:
            raise Conflict(f"snapshot {tag!r} is being deleted")
        self._read[tag] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._read[tag] -= 1
                if not self._read[tag]:
                    del self._read[tag]

        return release

    def being_read(self, tag: str) -> bool:
        return self._read[tag] > 0

    @contextlib.contextmanager
    def deleting(self, tags: Iterable[str]) -> Iterator[None]:
        """Snapshots ``tags`` are being deleted: no new diff over them."""
        held = set(tags) - self._deleting
        self._deleting |= held
        try:
            yield
        finally:
            self._deleting -= held

    def is_deleting(self, tag: str) -> bool:
        return tag in self._deleting

    # ------------------------------------------------------------ sandboxes

    def sandbox_lock(self, sandbox_id: str) -> asyncio.Lock:
        """The lock of ``sandbox_id``'s branches, pauses, resumes and hibernation."""
        return self._sandbox_locks.setdefault(sandbox_id, asyncio.Lock())

    def sandbox_busy(self, sandbox_id: str) -> bool:
        """Whether something holds ``sandbox_id``'s lock now (a branch, pause, resume)."""
        lock = self._sandbox_locks.get(sandbox_id)
        return lock is not None and lock.locked()

    def forget_sandbox(self, sandbox_id: str) -> None:
        """The sandbox is gone: a branch that queued on its lock meanwhile finds it dead
        (no new one can start on a dead sandbox); one in flight holds the object itself."""
        self._sandbox_locks.pop(sandbox_id, None)

    @contextlib.contextmanager
    def reading_hibernated(self, sandbox_id: str) -> Iterator[None]:
        """A branch copies the hibernated state of ``sandbox_id``: it is not discarded."""
        done = asyncio.Event()
        self._hibernated_readers.setdefault(sandbox_id, []).append(done)
        try:
            yield
        finally:
            done.set()
            readers = self._hibernated_readers[sandbox_id]
            readers.remove(done)
            if not readers:
                del self._hibernated_readers[sandbox_id]

    async def hibernated_unread(self, sandbox_id: str) -> None:
        """Once no branch is copying ``sandbox_id``'s hibernated state."""
        for done in list(self._hibernated_readers.get(sandbox_id, ())):
            await done.wait()

    @contextlib.contextmanager
    def waking(self, sandbox_id: str) -> Iterator[None]:
        """The hibernated ``sandbox_id`` is being restored: it is not killed meanwhile."""
        self._waking.add(sandbox_id)
        try:
            yield
        finally:
            self._waking.discard(sandbox_id)

    def is_waking(self, sandbox_id: str) -> bool:
        return sandbox_id in self._waking

    def want(self, sandbox_id: str) -> None:
        """A request is waking ``sandbox_id`` (:mod:`.waking`), until :meth:`unwant`:
        reclaim leaves it be."""
        self._wanted.add(sandbox_id)

    def unwant(self, sandbox_id: str) -> None:
        self._wanted.discard(sandbox_id)

    def is_wanted(self, sandbox_id: str) -> bool:
        return sandbox_id in self._wanted

    # ------------------------------------------------------------ volumes

    @contextlib.contextmanager
    def volume_layers(self) -> Iterator[None]:
        """A template build or a fork holds volume layers no registry entry names yet:
        no layer collection meanwhile."""
        self._volume_layer_ops += 1
        try:
            yield
        finally:
            self._volume_layer_ops -= 1

    def volume_layers_held(self) -> bool:
        return self._volume_layer_ops > 0

    def held(self) -> list[str]:
        """Every hold taken now, by name (empty when the daemon is idle)."""
        return sorted(
            [f"tag {t}" for t in self._tags]
            + [f"diff base {t}" for t, n in self._bases.items() if n]
            + [f"read {t}" for t, n in self._read.items() if n]
            + [f"deleting {t}" for t in self._deleting]
            + [f"reading hibernated {s}" for s in self._hibernated_readers]
            + [f"waking {s}" for s in self._waking]
            + [f"wanted {s}" for s in self._wanted]
            + [f"lock {s}" for s, lock in self._sandbox_locks.items() if lock.locked()]
            + (["volume layers"] if self._volume_layer_ops else [])
        )
