"""Diff snapshots' memory: the index, capture over a base, chains, apply into a mapping, flatten.

Guest RAM is played by a private mapping of a file in this process, as
test_memory_dump.py does: /proc/self/pagemap and /proc/self/mem stand for QEMU's.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from pathlib import Path

import pytest

from forkd.errors import SnapshotError, VMError
from forkd.vmm.qemu.argv import MachineConfig
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory, memory_diff
from forkd.vmm.snapshot.files import BaseRef, SnapshotMeta

PAGE = memory.PAGE
MIB = 1
SIZE = MIB << 20
NPAGES = SIZE // PAGE


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    d = tmp_path / "img"
    d.mkdir()
    for name in ("vmlinuz", "initrd.img", "rootfs.sqfs"):
        (d / name).write_bytes(b"x")
    return d


def _meta(image_dir: Path, tag: str, base: BaseRef | None = None) -> SnapshotMeta:
    machine = MachineConfig(
        MIB, 1, "tcg", image_dir / "vmlinuz", image_dir / "initrd.img", image_dir / "rootfs.sqfs"
    )
    return SnapshotMeta(
        machine=machine,
        image=None,
        created_at_unix=1,
        memory_bytes=SIZE,
        vmstate_bytes=5,
        source_vm=None,
        parent_snapshot=None,
        capture_ms=0.0,
        pages_written=0,
        base_bytes_cloned=0,
        tag=tag,
        mode="diff" if base else "full",
        base=base,
        chain=(base,) if base else (),
    )


def _full(root: Path, image_dir: Path, tag: str, data: bytes) -> Path:
    d = root / tag
    d.mkdir()
    (d / "vmstate").write_bytes(b"state")
    (d / "memory.bin").write_bytes(data)
    snapshot_files.write_meta(d, _meta(image_dir, tag))
    return d


def _map(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _diff_of_mapping(
    m: mmap.mmap, mapped: Path, base_dir: Path, dest: Path, image_dir: Path, limit: int = 1 << 30
) -> memory_diff.DiffCapture:
    """Capture ``m`` (a private mapping of ``mapped``) as a diff over ``base_dir``."""
    dest.mkdir()
    region = memory.find_ram_region(os.getpid(), mapped, SIZE)
    fd = os.open(dest / "memory.diff", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        cap = memory_diff.DiffCapture(fd, limit)
        cap.capture(region)
        with memory_diff.resolve(snapshot_files.load(base_dir)) as chain:
            cap.finish(chain, dest / "memory.runs")
    finally:
        os.close(fd)
    (dest / "vmstate").write_bytes(b"state")
    base = BaseRef(base_dir.name, str(base_dir))
    snapshot_files.write_meta(dest, _meta(image_dir, dest.name, base))
    return cap


def _contents(d: Path) -> bytes:
    with memory_diff.resolve(snapshot_files.load(d)) as chain:
        return chain.read(0, NPAGES)


def test_runs_index_round_trips_and_rejects_damage(tmp_path: Path) -> None:
    runs = [(0, 1), (5, 9), (200, 256)]
    memory_diff.write_runs(tmp_path / "r", runs)
    assert memory_diff.read_runs(tmp_path / "r", 256) == runs
    with pytest.raises(SnapshotError):
        memory_diff.read_runs(tmp_path / "r", 100)  # a run past the end
    (tmp_path / "bad").write_bytes(b"junk")
    with pytest.raises(SnapshotError, match="corrupt"):
        memory_diff.read_runs(tmp_path / "bad", 256)
    assert memory_diff.merge_runs([(5, 6), (0, 2), (2, 4), (6, 8)]) == [(0, 4), (5, 8)]


@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_diff_holds_exactly_the_changed_pages_zero_pages_included(
    tmp_path: Path, image_dir: Path, limit: int
) -> None:
    base_data = bytearray(os.urandom(SIZE))
    root = _full(tmp_path, image_dir, "root", bytes(base_data))
    m = _map(root / "memory.bin")
    try:
        m[3 * PAGE : 4 * PAGE] = bytes(PAGE)  # zeroes over data: data
        m[7 * PAGE : 9 * PAGE] = b"\x05" * (2 * PAGE)
        m[20 * PAGE : 21 * PAGE] = base_data[20 * PAGE : 21 * PAGE]  # written, unchanged
        expected = bytes(m)
        cap = _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir, limit)
    finally:
        m.close()
    runs = memory_diff.read_runs(tmp_path / "d1" / "memory.runs", NPAGES)
    if limit:  # filtered: the unchanged page is dropped
        assert runs == [(3, 4), (7, 9)]
    else:  # written at once, unfiltered: bigger, still right
        assert (3, 4) in runs and (7, 9) in runs
    assert cap.pages_read >= 4
    assert _contents(tmp_path / "d1") == expected


def test_chain_applied_into_a_fork_and_diffed_again_grows_by_one_level(
    tmp_path: Path, image_dir: Path
) -> None:
    root = _full(tmp_path, image_dir, "root", os.urandom(SIZE))
    # Level 1: a child of root writes pages 10-11.
    m = _map(root / "memory.bin")
    m[10 * PAGE : 12 * PAGE] = b"\x01" * (2 * PAGE)
    level1 = bytes(m)
    _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir)
    m.close()
    # A fork of d1: maps root, the chain is written in through /proc/self/mem.
    m = _map(root / "memory.bin")
    with memory_diff.resolve(snapshot_files.load(tmp_path / "d1")) as chain:
        assert chain.root == root / "memory.bin" and len(chain.layers) == 1
        assert memory_diff.apply(chain, os.getpid()) == 2
    assert bytes(m) == level1
    m[11 * PAGE : 12 * PAGE] = bytes(PAGE)  # overwrite a chain page with zeroes
    m[40 * PAGE : 41 * PAGE] = b"\x02" * PAGE
    level2 = bytes(m)
    _diff_of_mapping(m, root / "memory.bin", tmp_path / "d1", tmp_path / "d2", image_dir)
    m.close()
    # The chain page 10 (applied, unchanged) is not repeated in d2.
    assert memory_diff.read_runs(tmp_path / "d2" / "memory.runs", NPAGES) == [(11, 12), (40, 41)]
    assert _contents(tmp_path / "d2") == level2
    # Flattened: a full memory.bin with the same bytes.
    out = tmp_path / "flat.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
    with memory_diff.resolve(snapshot_files.load(tmp_path / "d2")) as chain:
        memory_diff.flatten(chain, fd)
    os.close(fd)
    assert out.read_bytes() == level2


def test_a_missing_base_is_named(tmp_path: Path, image_dir: Path) -> None:
    root = _full(tmp_path, image_dir, "root", os.urandom(SIZE))
    m = _map(root / "memory.bin")
    m[1 * PAGE : 2 * PAGE] = b"\x01" * PAGE
    _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir)
    m.close()
    (root / "memory.bin").unlink()
    with pytest.raises(SnapshotError, match="base 'root' of d1"):
        memory_diff.resolve(snapshot_files.load(tmp_path / "d1"))


def test_diff_of_a_file_over_its_base(tmp_path: Path, image_dir: Path) -> None:
    data = bytearray(os.urandom(SIZE))
    root = _full(tmp_path, image_dir, "root", bytes(data))
    data[5 * PAGE : 6 * PAGE] = bytes(PAGE)
    (tmp_path / "full.bin").write_bytes(bytes(data))
    fd = os.open(tmp_path / "out.diff", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, SIZE)
    with memory_diff.resolve(snapshot_files.load(root)) as chain:
        memory_diff.diff_of_file(tmp_path / "full.bin", chain, fd, tmp_path / "out.runs")
    os.close(fd)
    assert memory_diff.read_runs(tmp_path / "out.runs", NPAGES) == [(5, 6)]


def test_a_base_made_again_under_the_same_tag_is_not_the_base(
    tmp_path: Path, image_dir: Path
) -> None:
    root = _full(tmp_path, image_dir, "root", bytes(SIZE))
    root_id = snapshot_files.load(root).meta.id
    m = _map(root / "memory.bin")
    m[1 * PAGE : 2 * PAGE] = b"\x01" * PAGE
    _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir)
    m.close()
    meta = snapshot_files.load(tmp_path / "d1").meta
    snapshot_files.write_meta(
        tmp_path / "d1", dataclasses.replace(meta, base=BaseRef("root", str(root), root_id))
    )
    memory_diff.resolve(snapshot_files.load(tmp_path / "d1")).close()
    # The tag deleted and made again: same tag, same directory, another snapshot.
    snapshot_files.write_meta(root, dataclasses.replace(_meta(image_dir, "root"), id="new"))
    with pytest.raises(SnapshotError, match="replaced by another snapshot"):
        memory_diff.resolve(snapshot_files.load(tmp_path / "d1"))


def test_a_compaction_landing_inside_resolve_is_read_again(
    tmp_path: Path, image_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.vmm.snapshot import compact as snapshot_compact

    root = _full(tmp_path, image_dir, "root", bytes(SIZE))
    m = _map(root / "memory.bin")
    m[3 * PAGE : 4 * PAGE] = b"\x07" * PAGE
    _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir)
    m.close()
    files = snapshot_files.load(tmp_path / "d1")
    real = memory_diff.read_runs

    def racing(path: Path, npages: int) -> list[tuple[int, int]]:
        if path.parent == tmp_path / "d1" and files.is_diff and not racing.done:  # type: ignore[attr-defined]
            racing.done = True  # type: ignore[attr-defined]
            snapshot_compact.compact(tmp_path / "d1")  # memory.diff is open, memory.runs gone
        return real(path, npages)

    racing.done = False  # type: ignore[attr-defined]
    monkeypatch.setattr(memory_diff, "read_runs", racing)
    with memory_diff.resolve(files) as chain:  # the diff it was given is a full one now
        assert chain.layers == [] and chain.read(3, 4) == b"\x07" * PAGE
    # A damaged index with nothing moved is not read again: the error stands.
    monkeypatch.setattr(memory_diff, "read_runs", real)
    d2 = tmp_path / "d2"
    m = _map(root / "memory.bin")
    _diff_of_mapping(m, root / "memory.bin", root, d2, image_dir)
    m.close()
    (d2 / "memory.runs").write_bytes(b"junk")
    with pytest.raises(SnapshotError, match="corrupt"):
        memory_diff.resolve(snapshot_files.load(d2))


def test_every_level_of_a_chain_has_the_same_memory_size(tmp_path: Path, image_dir: Path) -> None:
    root = _full(tmp_path, image_dir, "root", bytes(SIZE))
    m = _map(root / "memory.bin")
    m[2 * PAGE : 3 * PAGE] = b"\x05" * PAGE
    _diff_of_mapping(m, root / "memory.bin", root, tmp_path / "d1", image_dir)
    # The same chain cannot be written past the RAM it is applied into.
    with memory_diff.resolve(snapshot_files.load(tmp_path / "d1")) as chain:
        chain.layers[0].runs = [(2, 3), (NPAGES - 1, NPAGES + 1)]
        before = bytes(m)
        with pytest.raises(VMError, match="past QEMU"):
            memory_diff.apply(chain, os.getpid())
        assert bytes(m) == before  # nothing written at all
    m.close()
    half = dataclasses.replace(_meta(image_dir, "root"), memory_bytes=SIZE // 2)
    snapshot_files.write_meta(root, half)
    with pytest.raises(SnapshotError, match="not one chain"):
        memory_diff.resolve(snapshot_files.load(tmp_path / "d1"))
