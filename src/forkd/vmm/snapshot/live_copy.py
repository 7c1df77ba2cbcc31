"""A full snapshot's guest pages copied mostly while the VM runs (branch mode ``live``).

The pause-copy way (:func:`forkd.vmm.snapshot.memory.dump_written_pages`) reads every
page the guest has written since its mapping was made inside the pause: about
100 ms per 100 MiB here. A live copy splits that:

1. VM running: arm the write tracker (:mod:`forkd.vmm.snapshot.write_tracking`), then
   copy every written page into the snapshot's ``memory.bin``. Pages the
   guest changes meanwhile may be copied half-old; the tracker has them.
2. VM paused: copy the pages the tracker saw written since step 1 (held in
   memory, written after the resume) and note the pages that stopped being
   the guest's own since step 1 (dropped by QEMU: they read as the base again).
3. VM running again: write what step 2 read; put the base's bytes back at the
   pages of the second kind.

The result is byte for byte what a pause-copy at the same pause would write.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

from forkd.vmm.snapshot import memory
from forkd.vmm.snapshot.memory import PAGE, DeferredWrites, DumpStats, RamRegion
from forkd.vmm.snapshot.write_tracking import WriteTracker

log = logging.getLogger(__name__)


def tracker_for(vm_pid: int, region: RamRegion, held: WriteTracker | None) -> WriteTracker:
    """``held`` when it still watches this region of this process, else a new tracker
    (blocking: :meth:`WriteTracker.attach`). Raises OSError when the host cannot."""
    if held is not None and (held.pid, held.start, held.end) == (
        vm_pid,
        region.start,
        region.end,
    ):
        return held
    if held is not None:
        held.close()
    return WriteTracker.attach(vm_pid, region.start, region.end)


def _mask(npages: int, runs: list[tuple[int, int]]) -> bytearray:
    """One byte per page: 1 inside the byte ranges ``runs``."""
    marks = bytearray(npages)
    for start, end in runs:
        first, last = start // PAGE, min(npages, -(-end // PAGE))
        marks[first:last] = b"\x01" * (last - first)
    return marks


@dataclass
class LiveCopy:
    """The pages of one full snapshot of ``region``'s guest, copied into ``out_fd``
    (already a clone of the base: :func:`memory.clone_base`)."""

    tracker: WriteTracker
    region: RamRegion
    out_fd: int
    base_is_empty: bool
    stats: DumpStats
    precopy_pages: int = 0
    _copied: bytes = b""  # pages written at the precopy: 1 bytes
    _reverted: list[tuple[int, int]] = field(default_factory=list)

    def precopy(self) -> None:
        """Step 1 (VM running, blocking)."""
        self.tracker.written_since_last()  # arm: from here on, writes are seen
        self._copied = memory.written_marks(self.region)
        runs = memory.runs_of(self._copied, memory.MAX_RUN_BYTES // PAGE)
        memory.copy_runs(self.region, self.out_fd, runs, self.base_is_empty, self.stats)
        self.precopy_pages = sum(end - first for first, end in runs)

    def capture(self, defer: DeferredWrites) -> None:
        """Step 2 (VM paused, blocking): read what changed since the precopy."""
        npages = self.region.size // PAGE
        now = memory.written_marks(self.region)
        self.stats.pages_scanned += npages
        changed = memory.marks_and(_mask(npages, self.tracker.written_since_last()), now)
        # A zero page written over a copied one must be written: never skipped.
        memory.copy_runs(
            self.region,
            self.out_fd,
            memory.runs_of(changed, memory.MAX_RUN_BYTES // PAGE),
            False,
            self.stats,
            defer,
        )
        self._reverted = memory.runs_of(
            memory.marks_and_not(self._copied, now), memory.MAX_RUN_BYTES // PAGE
        )

    def finish(self) -> None:
        """Step 3 (VM running, blocking): pages the guest no longer owns read as the base."""
        if not self._reverted:
            return
        with contextlib.closing(_Base(self.region)) as base:
            for first, end in self._reverted:
                base.restore(self.out_fd, first * PAGE, (end - first) * PAGE, self.base_is_empty)
        log.info("live snapshot: %d runs read as the base again", len(self._reverted))


class _Base:
    """The region's backing file, read to undo precopied pages."""

    def __init__(self, region: RamRegion) -> None:
        try:
            self.fd = os.open(region.map_file, os.O_RDONLY)
        except PermissionError:
            self.fd = os.open(region.path, os.O_RDONLY)

    def restore(self, out_fd: int, offset: int, length: int, base_is_empty: bool) -> None:
        data = b"" if base_is_empty else os.pread(self.fd, length, offset)
        # Beyond the file's end it reads as zeros.
        memory._pwrite_all(out_fd, data.ljust(length, b"\0"), offset)

    def close(self) -> None:
        os.close(self.fd)
