"""Copy a QEMU process's guest RAM into a sparse ``memory.bin``.

Guest RAM is a private mapping of a file (a fresh sparse file for a booted
VM, the snapshot's ``memory.bin`` for a forked one). Every page of that
mapping is in one of two states, and ``/proc/PID/pagemap`` tells which:

* written by the guest since the mapping was made: an anonymous page, the
  only place that content exists;
* anything else (never touched, or only read): identical to the backing
  file at the same offset.

So a snapshot is "the backing file, overlaid with the anonymous pages". The
backing file never changes, so it can be cloned *before* the VM is paused;
the pause then only covers reading pagemap and copying the written pages.
Pages that were never touched are never read, so snapshotting does not fault
the whole range into the QEMU process (which would inflate its RSS).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
ZERO_PAGE = bytes(PAGE)
PM_PRESENT = 1 << 63
PM_SWAPPED = 1 << 62
PM_FILE_OR_SHARED = 1 << 61
MAX_RUN_BYTES = 8 << 20  # one read from /proc/PID/mem at most
FICLONE = 0x40049409


@dataclass(frozen=True)
class RamRegion:
    pid: int
    start: int
    end: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def map_file(self) -> Path:
        """The backing file, reachable even if it was unlinked since."""
        return Path(f"/proc/{self.pid}/map_files/{self.start:x}-{self.end:x}")


@dataclass
class DumpStats:
    pages_scanned: int = 0
    pages_written: int = 0  # anonymous pages copied from the process
    zero_pages_skipped: int = 0
    base_bytes_cloned: int = 0
    cloned_by_reflink: bool = False


def inode_of(path: Path) -> int | None:
    """``path``'s inode number, or None when it cannot be read."""
    try:
        return path.stat().st_ino
    except OSError:
        return None


def find_ram_region(pid: int, ram_file: Path, size: int, inode: int | None = None) -> RamRegion:
    """The mapping of guest RAM (``ram_file``, ``size`` bytes) in process ``pid``.

    Found by the file's ``inode`` when it is known: the snapshot a child
    maps may have been renamed or deleted since it was forked (its children
    keep the mapping, and must stay branchable). Else by path; else the one
    mapping of that size of a file with the same name (a renamed snapshot's).
    """
    want = os.path.realpath(ram_file)  # /proc/PID/maps shows resolved paths
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError as exc:
        raise ProcessLookupError(f"QEMU process {pid} is gone ({exc})") from exc
    candidates: list[tuple[int, str, RamRegion]] = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[4] == "0":  # anonymous
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo == size:
            path = parts[5].removesuffix(" (deleted)")
            candidates.append((int(parts[4]), path, RamRegion(pid, lo, hi, path)))
    rules: tuple[Callable[[int, str], bool], ...] = (
        lambda ino, path: inode is not None and ino == inode,
        lambda ino, path: path == want,
    )
    for rule in rules:
        found = [region for ino, path, region in candidates if rule(ino, path)]
        if found:
            return found[0]
    same_name = [r for _, path, r in candidates if Path(path).name == Path(want).name]
    if len(same_name) == 1:
        return same_name[0]
    raise LookupError(f"no {size}-byte mapping of {want} in process {pid}")


def clone_base(region: RamRegion, out_fd: int) -> DumpStats:
    """Make ``out_fd`` a copy of the region's backing file (holes stay holes)."""
    stats = DumpStats()
    try:
        src = os.open(region.map_file, os.O_RDONLY)  # works even if the file was unlinked
    except PermissionError:  # map_files needs CAP_SYS_ADMIN: fall back to the path
        src = os.open(region.path, os.O_RDONLY)
    try:
        os.ftruncate(out_fd, region.size)
        stats.base_bytes_cloned, stats.cloned_by_reflink = copy_sparse(
            src, out_fd, region.size, region.path
        )
    finally:
        os.close(src)
    return stats


def copy_sparse(src: int, out_fd: int, size: int, name: str = "the source") -> tuple[int, bool]:
    """Copy the first ``size`` bytes of ``src`` into ``out_fd`` (already ``size`` long),
    holes staying holes; returns the bytes copied and whether it was a reflink.

    Tries a reflink first (instant on btrfs/XFS), else copies only the data
    extents in the kernel with copy_file_range.
    """
    if not _has_data(src):
        return 0, False  # a fresh VM's RAM file: nothing to copy
    src_size = os.fstat(src).st_size
    try:
        fcntl.ioctl(out_fd, FICLONE, src)
        os.ftruncate(out_fd, size)
        return src_size, True
    except OSError:
        pass
    copied = 0
    for data, hole in data_extents(src, min(src_size, size)):
        off = data
        while off < hole:
            n = os.copy_file_range(src, out_fd, hole - off, off, off)
            if n == 0:
                raise OSError(errno.EIO, f"short copy from {name} at {off}")
            off += n
        copied += hole - data
    return copied, False


def data_extents(fd: int, limit: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of each data extent of ``fd`` before ``limit``: holes skipped."""
    pos = 0
    while pos < limit:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                return
            raise
        if data >= limit:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), limit)
        yield data, hole
        pos = hole


def _has_data(fd: int) -> bool:
    try:
        os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return False
        raise
    return True


@dataclass
class DeferredWrites:
    """Pages read while the VM is paused, to be written once it runs again.

    Reading guest RAM is fast; writing it into a file is the slow half. Up
    to ``limit`` bytes are kept in memory and written by :meth:`flush` after
    the resume; anything beyond is written at once, inside the pause.
    """

    limit: int
    runs: list[tuple[int, bytes]] = field(default_factory=list)
    size: int = 0

    def take(self, offset: int, data: bytes) -> bool:
        if self.size + len(data) > self.limit:
            return False
        self.runs.append((offset, data))
        self.size += len(data)
        return True

    def flush(self, out_fd: int, *, base_is_empty: bool, stats: DumpStats) -> None:
        for offset, data in self.runs:
            _write_run(out_fd, data, offset, base_is_empty, stats)
        self.runs.clear()
        self.size = 0


def dump_written_pages(
    region: RamRegion,
    out_fd: int,
    *,
    base_is_empty: bool,
    stats: DumpStats | None = None,
    defer: DeferredWrites | None = None,
) -> DumpStats:
    """Overlay ``out_fd`` with every page the guest wrote (call while paused).

    ``base_is_empty``: the backing file was all holes (a freshly booted VM),
    so all-zero pages can be skipped and the file stays sparse. Otherwise a
    zero page must be written, since the base may hold data there. With
    ``defer``, pages are only read now and written by ``defer.flush()``.
    """
    stats = stats or DumpStats()
    marks = written_marks(region)
    stats.pages_scanned += len(marks)
    copy_runs(region, out_fd, runs_of(marks, MAX_RUN_BYTES // PAGE), base_is_empty, stats, defer)
    return stats


def written_marks(region: RamRegion) -> bytes:
    """One byte per page of ``region``: 1 where the guest wrote it (see the module)."""
    npages = region.size // PAGE
    with open(f"/proc/{region.pid}/pagemap", "rb", buffering=0) as pm:
        raw = os.pread(pm.fileno(), npages * 8, (region.start // PAGE) * 8)
    if len(raw) != npages * 8:
        raise OSError(errno.EIO, f"short pagemap read for process {region.pid}")
    return pagemap_marks(raw)


def copy_runs(
    region: RamRegion,
    out_fd: int,
    runs: list[tuple[int, int]],
    skip_zero: bool,
    stats: DumpStats,
    defer: DeferredWrites | None = None,
) -> None:
    """Copy the pages ``[first, end)`` of each run from the process into ``out_fd``."""
    if not runs:
        return
    mem = os.open(f"/proc/{region.pid}/mem", os.O_RDONLY)
    try:
        for first, end in runs:
            _copy_run(region, mem, out_fd, first, end, skip_zero, stats, defer)
    finally:
        os.close(mem)


# The flags live in the top byte of each little-endian pagemap entry.
# A page was written by the guest if it is swapped out, or present and
# anonymous (present without the file/shared bit).
_PRESENT, _SWAPPED, _FILE = (flag >> 56 for flag in (PM_PRESENT, PM_SWAPPED, PM_FILE_OR_SHARED))
_WRITTEN_BY_TOP_BYTE = bytes(
    1 if (b & _SWAPPED) or ((b & _PRESENT) and not (b & _FILE)) else 0 for b in range(256)
)
_SWAPPED_BY_TOP_BYTE = bytes(1 if b & _SWAPPED else 0 for b in range(256))
# A "swapped" entry of swap type 31 (the low 5 bits) is no page at all but a
# marker the kernel leaves where a write-protected page is not populated
# (write tracking, forkd.vmm.snapshot.write_tracking): it reads as the backing file.
# The type is shown to CAP_SYS_ADMIN only: without it a marker would count as
# written, so only a root daemon tracks writes (write_tracking.problem).
_PTE_MARKER_TYPE = 31
_MARKER_BY_LOW_BYTE = bytes(1 if b & 0x1F == _PTE_MARKER_TYPE else 0 for b in range(256))


def pagemap_marks(pagemap: bytes) -> bytes:
    """One byte per ``/proc/PID/pagemap`` entry: 1 where the guest wrote the page."""
    written = pagemap[7::8].translate(_WRITTEN_BY_TOP_BYTE)
    low = pagemap[0::8].translate(_MARKER_BY_LOW_BYTE)
    if 1 not in low:
        return written
    markers = marks_and(pagemap[7::8].translate(_SWAPPED_BY_TOP_BYTE), low)
    return marks_and_not(written, markers)


def marks_and(a: bytes | bytearray, b: bytes | bytearray) -> bytes:
    """Per-byte AND of two equally long 0/1 strings (C speed, through big integers)."""
    return (int.from_bytes(a, "little") & int.from_bytes(b, "little")).to_bytes(len(a), "little")


def marks_and_not(a: bytes, b: bytes) -> bytes:
    """The 1 bytes of ``a`` where ``b`` has 0."""
    return (int.from_bytes(a, "little") & ~int.from_bytes(b, "little")).to_bytes(len(a), "little")


def written_runs(pagemap: bytes, max_run: int) -> list[tuple[int, int]]:
    """``[first, end)`` page ranges of written pages, each at most ``max_run`` long.

    Works on whole byte strings (C speed): the scan of a 1 GiB guest's
    262,144 entries costs well under a millisecond per run found instead of
    a Python loop over every page.
    """
    return runs_of(pagemap_marks(pagemap), max_run)


def runs_of(marks: bytes, max_run: int) -> list[tuple[int, int]]:
    """``[first, end)`` ranges of the 1 bytes in ``marks``, each at most ``max_run`` long."""
    runs: list[tuple[int, int]] = []
    pos = marks.find(1)
    while pos >= 0:
        end = marks.find(0, pos)
        if end < 0:
            end = len(marks)
        for first in range(pos, end, max_run):
            runs.append((first, min(first + max_run, end)))
        pos = marks.find(1, end)
    return runs


def _copy_run(
    region: RamRegion,
    mem: int,
    out_fd: int,
    first: int,
    end: int,
    skip_zero: bool,
    stats: DumpStats,
    defer: DeferredWrites | None,
) -> None:
    length = (end - first) * PAGE
    offset = first * PAGE
    buf = os.pread(mem, length, region.start + offset)
    if len(buf) != length:
        raise OSError(errno.EIO, f"short read of guest RAM from process {region.pid}")
    if defer is not None and defer.take(offset, buf):
        return
    _write_run(out_fd, buf, offset, skip_zero, stats)


def _write_run(out_fd: int, buf: bytes, offset: int, skip_zero: bool, stats: DumpStats) -> None:
    npages = len(buf) // PAGE
    if not skip_zero:
        _pwrite_all(out_fd, buf, offset)
        stats.pages_written += npages
        return
    # Write maximal runs of non-zero pages; leave zero pages as holes.
    view = memoryview(buf)
    seg = -1
    for p in range(npages):
        is_zero = buf[p * PAGE : (p + 1) * PAGE] == ZERO_PAGE
        if is_zero:
            stats.zero_pages_skipped += 1
            if seg >= 0:
                _pwrite_all(out_fd, view[seg * PAGE : p * PAGE], offset + seg * PAGE)
                stats.pages_written += p - seg
                seg = -1
        elif seg < 0:
            seg = p
    if seg >= 0:
        _pwrite_all(out_fd, view[seg * PAGE : npages * PAGE], offset + seg * PAGE)
        stats.pages_written += npages - seg


def write_nonzero(fd: int, data: bytes, offset: int) -> None:
    """``data`` at ``offset`` in a fresh sparse file: its runs of non-zero pages only,
    zero pages left as holes (and a last part-page the same, a file's end)."""
    whole = len(data) - len(data) % PAGE
    _write_run(fd, data[:whole], offset, True, DumpStats())
    tail = data[whole:]
    if tail.count(0) != len(tail):
        _pwrite_all(fd, tail, offset + whole)


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write of memory.bin")
        view = view[n:]
        offset += n
