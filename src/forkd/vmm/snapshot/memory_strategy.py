"""A snapshot's guest memory, written one of three ways: full, live (precopy) or diff.

:class:`forkd.vmm.snapshot.writer.SnapshotWriter` opens the memory file in its
staging directory and calls the strategy :func:`for_snapshot` chose at each of
its steps: :meth:`~MemoryStrategy.prepare` while the VM runs,
:meth:`~MemoryStrategy.capture` while it is paused, :meth:`~MemoryStrategy.finish`
once it runs again, before the file is flushed.

* :class:`PauseCopyMemory` (full): the RAM file's base is cloned before the pause
  (:func:`memory.clone_base`), the pause reads the pages the guest wrote, and
  they are written after the resume (:class:`memory.DeferredWrites`).
* :class:`PrecopyMemory` (full, ``live``): the written pages are copied before
  the pause too and the pause reads only what changed since
  (:mod:`forkd.vmm.snapshot.live_copy`); where the host cannot track writes it is taken
  the pause-copy way.
* :class:`DiffMemory` (over ``base``, the snapshot the VM was forked from): only
  the written pages that differ from the base's memory, compared after the
  resume (:mod:`forkd.vmm.snapshot.memory_diff`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from forkd.errors import SnapshotError
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import live_copy, memory, memory_diff, write_tracking
from forkd.vmm.snapshot.files import BaseRef
from forkd.vmm.snapshot.memory import DumpStats, RamRegion
from forkd.vmm.snapshot.write_tracking import WriteTracker

DEFERRED_WRITE_LIMIT = 1 << 30  # guest RAM held in memory between pause and commit

# The writer's logger: its lines read as they did before the strategies were split out.
log = logging.getLogger("forkd.vmm.snapshot.writer")
T = TypeVar("T")


class RunInThread(Protocol):
    """The writer's worker-thread runner: ``fn(*args, **kwargs)`` off the event loop,
    tracked so that an abort waits for it before it closes the files it writes."""

    async def __call__(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...


class MemorySource(Protocol):
    """What the strategies read of the VM being snapshotted (:class:`forkd.vmm.vm.VM`)."""

    id: str
    pid: int
    origin: Path | None  # the snapshot directory it was forked from
    origin_id: str | None
    write_tracker: WriteTracker | None  # held across its live snapshots


@dataclass(frozen=True)
class MemoryRecord:
    """What a strategy puts in ``snapshot.json`` (:class:`snapshot_files.SnapshotMeta`)."""

    mode: str  # "full" or "diff"
    pages_written: int
    base_bytes_cloned: int
    precopied_pages: int = 0
    base: BaseRef | None = None
    chain: tuple[BaseRef, ...] = ()  # a diff's bases at the branch, the full root first


class MemoryStrategy(Protocol):
    """How one snapshot's guest memory is written into ``out_fd`` (its ``file_name``)."""

    file_name: str  # in the snapshot directory
    stats: DumpStats

    async def prepare(self, region: RamRegion, out_fd: int) -> None:
        """The VM runs."""

    async def capture(self, region: RamRegion, out_fd: int) -> None:
        """The VM is paused: as little as possible."""

    async def finish(self, out_fd: int, snapshot_dir: Path) -> None:
        """The VM runs again; ``out_fd`` is flushed after."""

    def record(self) -> MemoryRecord:
        """Its fields of ``snapshot.json``, once finished."""

    def close(self) -> None:
        """Let go of what it holds (committed or aborted); idempotent."""


def for_snapshot(
    vm: MemorySource, base: BaseRef | None, *, live: bool, thread: RunInThread
) -> MemoryStrategy:
    """The strategy for a snapshot of ``vm``: a diff over ``base`` when given (``live``
    is then ignored), else full, copied before the pause too when ``live``."""
    if base is not None:
        return DiffMemory(vm, base, thread)
    if live:
        return PrecopyMemory(vm, thread)
    return PauseCopyMemory(thread)


class PauseCopyMemory:
    """A full ``memory.bin``: the base cloned while the VM runs, the pages the guest
    wrote read in the pause and written after the resume."""

    file_name = snapshot_files.MEMORY

    def __init__(self, thread: RunInThread) -> None:
        self._thread = thread
        self.stats = DumpStats()
        # Pages read during the pause, written after the resume (in finish).
        self._deferred = memory.DeferredWrites(limit=DEFERRED_WRITE_LIMIT)

    def _base_is_empty(self) -> bool:
        """The clone was all holes (a freshly booted VM's): zero pages may stay holes."""
        return self.stats.base_bytes_cloned == 0

    async def prepare(self, region: RamRegion, out_fd: int) -> None:
        self.stats = await self._thread(memory.clone_base, region, out_fd)

    async def capture(self, region: RamRegion, out_fd: int) -> None:
        await self._thread(
            memory.dump_written_pages,
            region,
            out_fd,
            base_is_empty=self._base_is_empty(),
            stats=self.stats,
            defer=self._deferred,
        )

    async def finish(self, out_fd: int, snapshot_dir: Path) -> None:
        await self._thread(
            self._deferred.flush, out_fd, base_is_empty=self._base_is_empty(), stats=self.stats
        )

    def record(self) -> MemoryRecord:
        return MemoryRecord("full", self.stats.pages_written, self.stats.base_bytes_cloned)

    def close(self) -> None:
        self._deferred.runs.clear()


class PrecopyMemory(PauseCopyMemory):
    """A full ``memory.bin`` whose written pages are copied while the VM runs, the pause
    copying only what changed since (:mod:`forkd.vmm.snapshot.live_copy`). Where the host
    cannot track writes it is its parent, the pause-copy."""

    def __init__(self, vm: MemorySource, thread: RunInThread) -> None:
        super().__init__(thread)
        self._vm = vm
        self._copy: live_copy.LiveCopy | None = None  # None: taken the pause-copy way

    async def prepare(self, region: RamRegion, out_fd: int) -> None:
        await super().prepare(region, out_fd)
        self._copy = await self._precopy(region, out_fd)

    async def _precopy(self, region: RamRegion, out_fd: int) -> live_copy.LiveCopy | None:
        """The written pages copied now, while the VM runs; None where writes cannot be
        tracked (the pause copies them all)."""
        vm = self._vm
        reason = write_tracking.problem()
        if reason is not None:
            log.debug("live snapshot of %s taken with a pause-copy: %s", vm.id, reason)
            return None
        try:
            vm.write_tracker = await self._thread(
                live_copy.tracker_for, vm.pid, region, vm.write_tracker
            )
        except OSError as exc:
            log.warning("cannot track the writes of %s (%s): pause-copy instead", vm.id, exc)
            return None
        copy = live_copy.LiveCopy(
            vm.write_tracker,
            region,
            out_fd,
            base_is_empty=self._base_is_empty(),
            stats=self.stats,
        )
        await self._thread(copy.precopy)
        return copy

    async def capture(self, region: RamRegion, out_fd: int) -> None:
        if self._copy is None:
            await super().capture(region, out_fd)
            return
        await self._thread(self._copy.capture, self._deferred)

    async def finish(self, out_fd: int, snapshot_dir: Path) -> None:
        if self._copy is None:
            await super().finish(out_fd, snapshot_dir)
            return
        # After a precopy a zero page may overwrite a copied one: none is skipped.
        await self._thread(self._deferred.flush, out_fd, base_is_empty=False, stats=self.stats)
        await self._thread(self._copy.finish)

    def record(self) -> MemoryRecord:
        precopied = self._copy.precopy_pages if self._copy is not None else 0
        return dataclasses.replace(super().record(), precopied_pages=precopied)


class DiffMemory:
    """A ``memory.diff`` over ``base`` with its index ``memory.runs``: the pages the guest
    wrote read in the pause; after the resume those equal to the base's are dropped."""

    file_name = snapshot_files.MEMORY_DIFF

    def __init__(self, vm: MemorySource, base: BaseRef, thread: RunInThread) -> None:
        self._vm = vm
        self.base = base
        self._thread = thread
        self.stats = DumpStats()
        self._chain: memory_diff.Chain | None = None
        self._links: tuple[BaseRef, ...] = ()
        self._diff: memory_diff.DiffCapture | None = None

    async def prepare(self, region: RamRegion, out_fd: int) -> None:
        await self._thread(self.open_base, out_fd, region.size)

    def open_base(self, out_fd: int, size: int) -> None:
        """Open the base's chain (held by descriptors: a compaction may swap its files)
        and make ``out_fd`` ``size`` bytes of holes (blocking)."""
        origin, base = self._vm.origin, self.base
        if (
            origin is None
            or os.path.realpath(origin) != os.path.realpath(base.dir)
            or base.id is None
            or self._vm.origin_id != base.id
        ):
            raise SnapshotError(f"{self._vm.id} was not forked from {base.tag!r}: no diff over it")
        base_files = snapshot_files.load(Path(base.dir))
        if base_files.meta.id != base.id:  # its tag was deleted and made again
            raise SnapshotError(f"{base.tag!r} was replaced since {self._vm.id} was forked from it")
        self._chain = memory_diff.resolve(base_files)
        self._links = (*base_files.meta.chain, base)
        os.ftruncate(out_fd, size)
        self._diff = memory_diff.DiffCapture(out_fd, limit=DEFERRED_WRITE_LIMIT)

    async def capture(self, region: RamRegion, out_fd: int) -> None:
        assert self._diff is not None
        await self._thread(self._diff.capture, region)

    async def finish(self, out_fd: int, snapshot_dir: Path) -> None:
        assert self._diff is not None and self._chain is not None
        runs = snapshot_dir / snapshot_files.MEMORY_RUNS
        await self._thread(self._diff.finish, self._chain, runs)
        self.stats.pages_written = self._diff.pages_kept
        runs.chmod(0o600)

    def record(self) -> MemoryRecord:
        return MemoryRecord(
            "diff",
            self.stats.pages_written,
            self.stats.base_bytes_cloned,
            base=self.base,
            chain=self._links,
        )

    def close(self) -> None:
        if self._chain is not None:
            self._chain.close()
            self._chain = None
        self._diff = None
