"""The RAM copy used by snapshots, run against a private file mapping in this process."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from forkd.vmm.snapshot import memory

PAGE = memory.PAGE
NPAGES = 64


def _map_private(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(
            fd, NPAGES * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)


def _snapshot(path: Path, out: Path, defer_limit: int | None = None) -> memory.DumpStats:
    region = memory.find_ram_region(os.getpid(), path, NPAGES * PAGE)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        stats = memory.clone_base(region, fd)
        empty = stats.base_bytes_cloned == 0
        defer = memory.DeferredWrites(defer_limit) if defer_limit is not None else None
        memory.dump_written_pages(region, fd, base_is_empty=empty, stats=stats, defer=defer)
        if defer is not None:
            # What was deferred is not in the file until flushed.
            assert defer_limit is not None and defer.size <= defer_limit
            defer.flush(fd, base_is_empty=empty, stats=stats)
        return stats
    finally:
        os.close(fd)


@pytest.mark.parametrize("defer_limit", [None, 0, 2 * PAGE, 1 << 30])
def test_child_snapshot_is_base_overlaid_with_written_pages(
    tmp_path: Path, defer_limit: int | None
) -> None:
    base = tmp_path / "memory.bin"
    data = bytearray(os.urandom(NPAGES * PAGE))
    data[10 * PAGE : 20 * PAGE] = bytes(10 * PAGE)  # a zero stretch in the base
    base.write_bytes(data)
    m = _map_private(base)
    try:
        _ = m[3 * PAGE]  # read: page present but still the file's
        m[5 * PAGE : 6 * PAGE] = b"\x01" * PAGE  # written
        m[12 * PAGE : 14 * PAGE] = b"\x02" * (2 * PAGE)  # written over a zero stretch
        m[30 * PAGE : 31 * PAGE] = bytes(PAGE)  # zeroes written over random data
        expected = bytes(m)
        stats = _snapshot(base, tmp_path / "snap.bin", defer_limit)
    finally:
        m.close()
    assert (tmp_path / "snap.bin").read_bytes() == expected
    assert stats.pages_written == 4  # only the written pages were copied from the process
    assert stats.base_bytes_cloned == NPAGES * PAGE
    assert base.read_bytes() == bytes(data)  # the base file is never written


@pytest.mark.parametrize("defer_limit", [None, 1 << 30])
def test_fresh_vm_snapshot_stays_sparse(tmp_path: Path, defer_limit: int | None) -> None:
    ram = tmp_path / "ram.bin"
    with ram.open("wb") as f:
        f.truncate(NPAGES * PAGE)
    m = _map_private(ram)
    try:
        m[7 * PAGE : 9 * PAGE] = b"\x07" * (2 * PAGE)
        m[40 * PAGE : 41 * PAGE] = bytes(PAGE)  # written, but zero: left as a hole
        expected = bytes(m)
        out = tmp_path / "snap.bin"
        stats = _snapshot(ram, out, defer_limit)
    finally:
        m.close()
    assert out.read_bytes() == expected
    assert stats.base_bytes_cloned == 0
    assert stats.pages_written == 2
    assert stats.zero_pages_skipped == 1
    assert out.stat().st_blocks * 512 <= 4 * PAGE


def test_region_lookup_names_the_missing_mapping(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match=r"no .* mapping"):
        memory.find_ram_region(os.getpid(), tmp_path / "nothing", PAGE)


def test_written_runs_from_pagemap_flags() -> None:
    import struct

    present, swapped, file_ = memory.PM_PRESENT, memory.PM_SWAPPED, memory.PM_FILE_OR_SHARED
    flags = [0, present, present | file_, swapped, present, 0, present | 123, present | 7]
    raw = b"".join(struct.pack("<Q", f) for f in flags)
    # pages 1 (anonymous), 3 (swapped), 4, 6, 7 are the guest's; 2 is the file's
    assert memory.written_runs(raw, 64) == [(1, 2), (3, 5), (6, 8)]
    assert memory.written_runs(raw, 1) == [(1, 2), (3, 4), (4, 5), (6, 7), (7, 8)]
    assert memory.written_runs(struct.pack("<Q", 0) * 4, 8) == []


def test_region_is_found_by_inode_after_its_file_is_renamed_and_deleted(tmp_path: Path) -> None:
    # A child keeps mapping memory.bin after its snapshot is deleted; it must
    # stay branchable, so the mapping is found by inode, not by path.
    path = tmp_path / "snap" / "memory.bin"
    path.parent.mkdir()
    path.write_bytes(b"\1" * NPAGES * PAGE)
    inode = path.stat().st_ino
    mapping = _map_private(path)
    try:
        trash = tmp_path / ".snap.partial-del-x"
        path.parent.rename(trash)
        (trash / "memory.bin").unlink()
        with pytest.raises(LookupError):
            memory.find_ram_region(os.getpid(), tmp_path / "other" / "ram", NPAGES * PAGE)
        region = memory.find_ram_region(os.getpid(), path, NPAGES * PAGE, inode)
        assert region.size == NPAGES * PAGE
        assert region.path == str(trash / "memory.bin")
        # Without the inode, the one mapping named memory.bin of that size serves.
        assert memory.find_ram_region(os.getpid(), path, NPAGES * PAGE).start == region.start
    finally:
        mapping.close()
