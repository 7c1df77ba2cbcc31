"""Diff snapshots: guest RAM stored as the pages that differ from a base snapshot.

A diff snapshot has, beside ``vmstate`` and ``snapshot.json``:

* ``memory.diff``: a sparse file as long as guest RAM, holding its pages at
  their own offsets;
* ``memory.runs``: the index of the pages it holds, as sorted ``[first, end)``
  page runs. A sparse file alone cannot tell a zero page the guest wrote
  (over non-zero base data: that is data) from a hole, so the index decides.

A snapshot's memory is its base's memory overlaid with its own pages; a full
snapshot's is its ``memory.bin``. :func:`resolve` walks the base references on
disk (not the chain recorded at the branch), so a compacted middle layer
shortens every chain above it. A fork maps the chain's root ``memory.bin``
privately and :func:`apply` writes the layers' pages into that mapping
through ``/proc/PID/mem`` before the guest runs.

The pages a VM wrote since its mapping was made are its anonymous pages
(:mod:`forkd.vmm.snapshot.memory`); for a fork of a diff those include the pages
:func:`apply` wrote. :class:`DiffCapture` keeps only the pages that differ
from the base, so a chain's depth costs only what each level changed.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from forkd import limits
from forkd.errors import SnapshotError, VMError
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory
from forkd.vmm.snapshot.files import BaseRef, SnapshotFiles

PAGE = memory.PAGE
RUNS_MAGIC = b"FKRUNS1\n"
_HEADER = struct.Struct("<8sQQ")  # magic, page size, number of runs
_RUN = struct.Struct("<QQ")  # first page, end page (exclusive)
CHUNK_PAGES = memory.MAX_RUN_BYTES // PAGE


# ------------------------------------------------------------------ the index


def runs_bytes(runs: list[tuple[int, int]]) -> bytes:
    """The index ``runs`` (sorted, disjoint ``[first, end)`` pages) as ``memory.runs`` holds it."""
    body = b"".join(_RUN.pack(first, end) for first, end in runs)
    return _HEADER.pack(RUNS_MAGIC, PAGE, len(runs)) + body


def write_runs(path: Path, runs: list[tuple[int, int]]) -> None:
    """Write the index ``runs`` (sorted, disjoint ``[first, end)`` pages) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        memory._pwrite_all(fd, runs_bytes(runs), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_runs(path: Path, npages: int) -> list[tuple[int, int]]:
    """The index at ``path``; :class:`SnapshotError` naming it when it is damaged."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{path} is unreadable: {exc}") from exc
    return parse_runs(raw, npages, str(path))


def parse_runs(raw: bytes, npages: int, where: str) -> list[tuple[int, int]]:
    """An index read from ``where``: :class:`SnapshotError` naming it when it is damaged
    (runs out of order, overlapping, empty or past ``npages``)."""
    try:
        magic, page, count = _HEADER.unpack_from(raw)
    except struct.error as exc:
        raise SnapshotError(f"{where} is corrupt: {exc}") from exc
    if magic != RUNS_MAGIC or page != PAGE or len(raw) != _HEADER.size + count * _RUN.size:
        raise SnapshotError(f"{where} is corrupt (magic, page size or length)")
    runs = [_RUN.unpack_from(raw, _HEADER.size + i * _RUN.size) for i in range(count)]
    last = 0
    for first, end in runs:
        if first < last or end <= first or end > npages:
            raise SnapshotError(f"{where} is corrupt: run {first}-{end} out of order or range")
        last = end
    return runs


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted runs with adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for first, end in sorted(runs):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


# ------------------------------------------------------------------ chains


@dataclass
class Layer:
    """One diff snapshot's pages, its file held open (a compaction may swap the directory)."""

    dir: Path
    fd: int
    runs: list[tuple[int, int]]
    _firsts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._firsts = [first for first, _ in self.runs]

    def overlapping(self, first: int, end: int) -> list[tuple[int, int]]:
        """The parts of this layer's runs inside pages ``[first, end)``."""
        i = max(bisect.bisect_right(self._firsts, first) - 1, 0)
        out = []
        while i < len(self.runs) and self.runs[i][0] < end:
            lo, hi = max(self.runs[i][0], first), min(self.runs[i][1], end)
            if lo < hi:
                out.append((lo, hi))
            i += 1
        return out


@dataclass
class Chain:
    """A snapshot's memory: the root's ``memory.bin`` and the layers above it, oldest first."""

    root: Path
    root_fd: int
    size: int
    layers: list[Layer]

    def close(self) -> None:
        for fd in (self.root_fd, *(layer.fd for layer in self.layers)):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def read(self, first: int, end: int) -> bytes:
        """The snapshot's content of pages ``[first, end)``, every layer applied."""
        length = (end - first) * PAGE
        buf = bytearray(os.pread(self.root_fd, length, first * PAGE))
        buf.extend(bytes(length - len(buf)))  # past a short root: zeroes
        for layer in self.layers:
            for lo, hi in layer.overlapping(first, end):
                data = _pread_all(layer.fd, (hi - lo) * PAGE, lo * PAGE, layer.dir)
                buf[(lo - first) * PAGE : (hi - first) * PAGE] = data
        return bytes(buf)

    def newest_first_runs(self) -> list[tuple[Layer, int, int]]:
        """Each page held by any layer once, from the newest layer that holds it."""
        covered = bytearray(self.size // PAGE)
        out: list[tuple[Layer, int, int]] = []
        for layer in reversed(self.layers):
            for first, end in layer.runs:
                for lo, hi in _zero_runs(covered, first, end):
                    out.append((layer, lo, hi))
                covered[first:end] = b"\x01" * (end - first)
        return out


def _zero_runs(marks: bytearray, first: int, end: int) -> list[tuple[int, int]]:
    out = []
    pos = marks.find(0, first, end)
    while pos >= 0:
        stop = marks.find(1, pos, end)
        stop = end if stop < 0 else stop
        out.append((pos, stop))
        pos = marks.find(0, stop, end)
    return out


def resolve(files: SnapshotFiles) -> Chain:
    """Open the chain under ``files``: follow base references down to a full snapshot.

    :class:`SnapshotError` names the snapshot whose base is missing, replaced
    (its tag differs) or damaged, or a chain deeper than ``limits.MAX_DIFF_DEPTH``. A
    compaction that swapped ``files.dir`` (or a level under it) while it was read is
    read again, once: a file missing, or an error after a level's directory changed.
    """
    visited: dict[Path, int] = {}
    try:
        try:
            return _resolve(files, visited)
        except (FileNotFoundError, SnapshotError) as exc:
            if isinstance(exc, SnapshotError) and not _moved(visited):
                raise
            return _resolve(snapshot_files.load(files.dir), {})
    except OSError as exc:
        raise SnapshotError(f"reading the memory of {files.dir} failed: {exc}") from exc


def _moved(visited: dict[Path, int]) -> bool:
    """Whether a directory read is no longer the one it was (swapped, or gone)."""
    for d, ino in visited.items():
        try:
            if os.stat(d).st_ino != ino:
                return True
        except OSError:
            return True
    return False


def _resolve(files: SnapshotFiles, visited: dict[Path, int]) -> Chain:
    layers: list[Layer] = []
    seen: set[Path] = set()
    cur = files
    try:
        while cur.meta.mode == "diff":
            if cur.dir in seen or len(seen) >= limits.MAX_DIFF_DEPTH:
                raise SnapshotError(f"the diff chain under {files.dir} loops or is too deep")
            seen.add(cur.dir)
            visited[cur.dir] = os.stat(cur.dir).st_ino
            layers.append(_open_layer(cur))
            base = cur.meta.base
            assert base is not None  # load() checks a diff names its base
            try:
                nxt = snapshot_files.load(Path(base.dir))
            except SnapshotError as exc:
                raise SnapshotError(
                    f"base {base.tag!r} of {cur.dir.name} is unusable: {exc}"
                ) from exc
            _check_base(cur, base, nxt)
            if nxt.meta.memory_bytes != files.meta.memory_bytes:  # one guest RAM size
                raise SnapshotError(
                    f"base {base.tag!r} of {cur.dir.name} holds {nxt.meta.memory_bytes} bytes "
                    f"of memory, {files.dir.name} {files.meta.memory_bytes}: not one chain"
                )
            cur = nxt
        root_fd = os.open(cur.memory, os.O_RDONLY)
    except BaseException:
        for layer in layers:
            os.close(layer.fd)
        raise
    layers.reverse()
    return Chain(cur.memory, root_fd, files.meta.memory_bytes, layers)


def _check_base(cur: SnapshotFiles, base: BaseRef, found: SnapshotFiles) -> None:
    """``found`` (at ``base.dir``) must be the snapshot ``cur`` was taken over: same tag,
    and same id when ``cur`` recorded one (a tag deleted and made again is another)."""
    if found.meta.tag not in (None, base.tag):
        raise SnapshotError(
            f"base {base.tag!r} of {cur.dir.name} was replaced by {found.meta.tag!r}"
        )
    if base.id is not None and found.meta.id != base.id:
        raise SnapshotError(
            f"base {base.tag!r} of {cur.dir.name} was replaced by another snapshot of that tag"
        )


def _open_layer(files: SnapshotFiles) -> Layer:
    npages = files.meta.memory_bytes // PAGE
    fd = os.open(files.dir / snapshot_files.MEMORY_DIFF, os.O_RDONLY)
    try:
        runs = read_runs(files.dir / snapshot_files.MEMORY_RUNS, npages)
    except BaseException:
        os.close(fd)
        raise
    return Layer(files.dir, fd, runs)


def _pread_all(fd: int, length: int, offset: int, where: Path) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise SnapshotError(f"{where / snapshot_files.MEMORY_DIFF} is short at {offset}")
    return data


# ------------------------------------------------------------------ forks


def apply(chain: Chain, pid: int) -> int:
    """Write the chain's layers into QEMU ``pid``'s private mapping of the root; returns
    the pages written. Call before the guest runs (QEMU waiting for its state)."""
    if not chain.layers:
        return 0
    try:
        region = memory.find_ram_region(pid, chain.root, chain.size, memory.inode_of(chain.root))
    except (OSError, LookupError) as exc:  # QEMU gone, or its RAM not mapped
        raise VMError(f"cannot write the diff chain into QEMU {pid}: {exc}") from exc
    runs = chain.newest_first_runs()
    past = [(first, end) for _, first, end in runs if end * PAGE > region.size]
    if past:  # never written past QEMU's RAM (resolve() checks every layer's size)
        raise VMError(f"the diff chain holds pages {past[0]} past QEMU {pid}'s RAM")
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    except OSError as exc:  # QEMU gone
        raise VMError(f"cannot write the diff chain into QEMU {pid}: {exc}") from exc
    written = 0
    try:
        for layer, first, end in runs:
            for lo in range(first, end, CHUNK_PAGES):
                hi = min(lo + CHUNK_PAGES, end)
                data = _pread_all(layer.fd, (hi - lo) * PAGE, lo * PAGE, layer.dir)
                memory._pwrite_all(mem, data, region.start + lo * PAGE)
                written += hi - lo
    except OSError as exc:
        raise VMError(f"writing the diff chain into QEMU {pid} failed: {exc}") from exc
    finally:
        os.close(mem)
    return written


def flatten(chain: Chain, out_fd: int) -> int:
    """Make ``out_fd`` the chain's whole memory (a full ``memory.bin``); returns bytes copied
    from the root (holes stay holes, a reflink where the filesystem has one)."""
    os.ftruncate(out_fd, chain.size)
    copied, _ = memory.copy_sparse(chain.root_fd, out_fd, chain.size, str(chain.root))
    for layer, first, end in chain.newest_first_runs():
        for lo in range(first, end, CHUNK_PAGES):
            hi = min(lo + CHUNK_PAGES, end)
            data = _pread_all(layer.fd, (hi - lo) * PAGE, lo * PAGE, layer.dir)
            memory._pwrite_all(out_fd, data, lo * PAGE)
    return copied


# ------------------------------------------------------------------ capture


def differing(first: int, data: bytes, old: bytes) -> Iterator[tuple[int, memoryview]]:
    """The runs of ``data``'s pages (page ``first`` on) that differ from ``old``, the same
    pages before: ``(first page of the run, its bytes)``, each run as long as it goes."""
    if data == old:
        return
    view = memoryview(data)
    npages = len(data) // PAGE
    seg = -1
    for p in range(npages + 1):
        same = p == npages or data[p * PAGE : (p + 1) * PAGE] == old[p * PAGE : (p + 1) * PAGE]
        if not same and seg < 0:
            seg = p
        elif same and seg >= 0:
            yield first + seg, view[seg * PAGE : p * PAGE]
            seg = -1


@dataclass
class DiffCapture:
    """The pages of one diff snapshot: read while the VM is paused, filtered and written
    after it runs again. Up to ``limit`` bytes wait in memory; beyond, pages are written
    at once, unfiltered (a diff may hold pages equal to its base: still correct)."""

    out_fd: int
    limit: int
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    pending_bytes: int = 0
    kept: list[tuple[int, int]] = field(default_factory=list)
    pages_read: int = 0
    pages_kept: int = 0

    def capture(self, region: memory.RamRegion) -> None:
        """Read every page the guest (or :func:`apply`) wrote. The VM must be paused."""
        npages = region.size // PAGE
        with open(f"/proc/{region.pid}/pagemap", "rb", buffering=0) as pm:
            raw = os.pread(pm.fileno(), npages * 8, (region.start // PAGE) * 8)
        if len(raw) != npages * 8:
            raise OSError(errno.EIO, f"short pagemap read for process {region.pid}")
        mem = os.open(f"/proc/{region.pid}/mem", os.O_RDONLY)
        try:
            for first, end in memory.written_runs(raw, CHUNK_PAGES):
                length = (end - first) * PAGE
                data = os.pread(mem, length, region.start + first * PAGE)
                if len(data) != length:
                    raise OSError(errno.EIO, f"short read of guest RAM from {region.pid}")
                self.take(first, data)
        finally:
            os.close(mem)

    def take(self, first: int, data: bytes) -> None:
        self.pages_read += len(data) // PAGE
        if self.pending_bytes + len(data) <= self.limit:
            self.pending.append((first, data))
            self.pending_bytes += len(data)
        else:
            self._keep(first, data)

    def finish(self, base: Chain, runs_path: Path) -> None:
        """Drop the pages equal to ``base``'s, write the rest and the index."""
        for first, data in self.pending:
            self._filter(first, data, base)
        self.pending.clear()
        self.pending_bytes = 0
        write_runs(runs_path, merge_runs(self.kept))

    def _filter(self, first: int, data: bytes, base: Chain) -> None:
        old = base.read(first, first + len(data) // PAGE)
        for at, pages in differing(first, data, old):
            self._keep(at, pages)

    def _keep(self, first: int, data: bytes | memoryview) -> None:
        memory._pwrite_all(self.out_fd, data, first * PAGE)
        npages = len(data) // PAGE
        self.kept.append((first, first + npages))
        self.pages_kept += npages


def _chunks(full: Path, npages: int) -> Iterator[tuple[int, bytes]]:
    """The memory file ``full`` as ``(first page, its bytes)`` chunks of ``npages`` pages;
    past a short file, zeroes."""
    fd = os.open(full, os.O_RDONLY)
    try:
        for first in range(0, npages, CHUNK_PAGES):
            length = (min(first + CHUNK_PAGES, npages) - first) * PAGE
            data = os.pread(fd, length, first * PAGE)
            yield first, data + bytes(length - len(data))
    finally:
        os.close(fd)


def count_differing(full: Path, base: Chain) -> int:
    """How many pages of the full memory file ``full`` differ from ``base``'s: what a diff
    of it over ``base`` would store. Nothing is written."""
    count = 0
    for first, data in _chunks(full, base.size // PAGE):
        old = base.read(first, first + len(data) // PAGE)
        count += sum(len(run) // PAGE for _, run in differing(first, data, old))
    return count


def diff_of_file(full: Path, base: Chain, out_fd: int, runs_path: Path) -> DiffCapture:
    """A diff of the full memory file ``full`` over ``base`` (a snapshot on disk, no VM)."""
    cap = DiffCapture(out_fd, limit=0)
    for first, data in _chunks(full, base.size // PAGE):
        cap.pages_read += len(data) // PAGE
        cap._filter(first, data, base)
    write_runs(runs_path, merge_runs(cap.kept))
    return cap
