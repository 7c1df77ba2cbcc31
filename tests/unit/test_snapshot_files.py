"""snapshot.json and vm.json: the keys on disk, the checks on load, the readers over a root."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from forkd.errors import SnapshotError, StorageFull
from forkd.guest.image import Image, users_of
from forkd.vmm import runtime_meta
from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot.files import ImageRef, SnapshotLabels, SnapshotMeta
from forkd.vmm.snapshot.writer import SnapshotWriter
from forkd.vmm.volumes.disks import Attachment

# The keys integration tests and older daemons read, in the order they are written.
SNAPSHOT_KEYS = [
    "format",
    "created_at_unix",
    "forkd_version",
    "image",
    "machine",
    "memory_bytes",
    "vmstate_bytes",
    "source_vm",
    "parent_snapshot",
    "capture_ms",
    "pages_written",
    "base_bytes_cloned",
]
LABEL_KEYS = ["tag", "branched_from", "parent_tag", "pause_ms"]
VM_KEYS = [
    "id",
    "pid",
    "qmp",
    "agent",
    "ram_file",
    "origin_snapshot",
    "machine",
    "image",
    "started_at_unix",
    "volumes",
    "origin_id",
]
MEMORY_MIB = 1


def _machine(image_dir: Path) -> MachineConfig:
    return MachineConfig(
        memory_mib=MEMORY_MIB,
        vcpus=1,
        accel="tcg",
        vmlinuz=image_dir / "vmlinuz",
        initrd=image_dir / "initrd.img",
        rootfs=image_dir / "rootfs.sqfs",
    )


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    d = tmp_path / "images" / "python-abc"
    d.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.sqfs"):
        (d / name).write_bytes(b"x")
    return d


VOLUME = Attachment("data", "/data", False, ("/v/data/layers/a.qcow2", "/v/data/base.img"))


def _meta(image_dir: Path, **labels: object) -> SnapshotMeta:
    return SnapshotMeta(
        machine=_machine(image_dir),
        image=ImageRef("python", "abc", str(image_dir)),
        created_at_unix=1700000000,
        memory_bytes=MEMORY_MIB << 20,
        vmstate_bytes=5,
        source_vm="vm-1",
        parent_snapshot="/snaps/base",
        capture_ms=12.5,
        pages_written=7,
        base_bytes_cloned=4096,
        volumes=(VOLUME,),
        **labels,  # type: ignore[arg-type]
    )


def _write_snapshot(d: Path, meta: SnapshotMeta) -> Path:
    d.mkdir(parents=True)
    (d / "vmstate").write_bytes(b"state")
    (d / "memory.bin").write_bytes(bytes(MEMORY_MIB << 20))
    snapshot_files.write_meta(d, meta)
    return d


# ------------------------------------------------------------ the record


def test_meta_writes_todays_keys_and_reads_them_back(image_dir: Path) -> None:
    meta = _meta(image_dir)
    data = meta.to_json()
    assert list(data) == [*SNAPSHOT_KEYS, "volumes"]  # no label given: none written
    assert data["image"] == {"name": "python", "key": "abc", "dir": str(image_dir)}
    assert data["machine"] == meta.machine.to_json()
    assert data["volumes"] == [
        {"name": "data", "path": "/data", "readonly": False, "chain": list(VOLUME.chain)}
    ]
    assert SnapshotMeta.from_json(json.loads(json.dumps(data))) == meta


def test_labels_are_written_only_when_given(image_dir: Path) -> None:
    branch = _meta(image_dir, tag="b1", branched_from="sb-3", parent_tag="base", pause_ms=41.5)
    data = branch.to_json()
    assert list(data) == [*SNAPSHOT_KEYS, *LABEL_KEYS, "volumes"]
    assert (data["tag"], data["branched_from"], data["parent_tag"], data["pause_ms"]) == (
        "b1",
        "sb-3",
        "base",
        41.5,
    )
    assert SnapshotMeta.from_json(data) == branch
    assert branch.labels == SnapshotLabels("b1", "sb-3", "base", 41.5)
    template = _meta(image_dir, tag="t1").to_json()
    assert "tag" in template and "branched_from" not in template and "pause_ms" not in template


def test_older_records_with_unknown_or_missing_keys_still_read(image_dir: Path) -> None:
    data = {"format": 1, "machine": _machine(image_dir).to_json(), "someday": {"x": 1}}
    meta = SnapshotMeta.from_json(data)
    assert meta.image is None and meta.volumes == () and meta.tag is None
    assert meta.memory_bytes == MEMORY_MIB << 20
    assert meta.to_json()["image"] == {}  # a record without an image writes {}, as before


# ------------------------------------------------------------ load


def test_load_returns_files_and_the_typed_record(tmp_path: Path, image_dir: Path) -> None:
    meta = _meta(image_dir, tag="t")
    snap = snapshot_files.load(_write_snapshot(tmp_path / "t", meta))
    assert snap.meta.id and snap.meta.id.startswith("legacy-")  # a record without an id
    assert snap.meta == dataclasses.replace(meta, id=snap.meta.id)
    assert snap.machine == meta.machine
    assert snap.vmstate == tmp_path / "t" / "vmstate"
    assert snap.memory == tmp_path / "t" / "memory.bin"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "snapshot.json").unlink(), r"snapshot\.json is missing"),
        (lambda d: (d / "snapshot.json").write_text("{not json"), r"snapshot\.json is unreadable"),
        (lambda d: (d / "snapshot.json").write_text("{}"), r"snapshot\.json is unreadable"),
        (lambda d: (d / "vmstate").unlink(), r"vmstate is missing"),
        (lambda d: (d / "vmstate").write_bytes(b"longer state"), r"vmstate is corrupt"),
        (lambda d: (d / "memory.bin").unlink(), r"memory\.bin is missing"),
        (lambda d: os.truncate(d / "memory.bin", 4096), r"memory\.bin is corrupt"),
    ],
)
def test_load_names_the_damaged_file(
    tmp_path: Path, image_dir: Path, damage: object, message: str
) -> None:
    d = _write_snapshot(tmp_path / "s", _meta(image_dir))
    damage(d)  # type: ignore[operator]
    with pytest.raises(SnapshotError, match=message) as info:
        snapshot_files.load(d)
    assert str(d) in str(info.value)


def test_load_refuses_another_format_and_a_missing_image_file(
    tmp_path: Path, image_dir: Path
) -> None:
    d = _write_snapshot(tmp_path / "s", _meta(image_dir))
    data = json.loads((d / "snapshot.json").read_text())
    (d / "snapshot.json").write_text(json.dumps({**data, "format": 2}))
    with pytest.raises(SnapshotError, match="has format 2, expected 1"):
        snapshot_files.load(d)
    (d / "snapshot.json").write_text(json.dumps(data))
    (image_dir / "rootfs.sqfs").unlink()
    with pytest.raises(SnapshotError, match=r"image file .*rootfs\.sqfs is missing"):
        snapshot_files.load(d)
    with pytest.raises(SnapshotError, match="does not exist"):
        snapshot_files.load(tmp_path / "nowhere")


# ------------------------------------------------------------ readers over a root


def test_recorded_volumes_skips_what_it_cannot_read(tmp_path: Path, image_dir: Path) -> None:
    root = tmp_path / "snaps"
    _write_snapshot(root / "good", _meta(image_dir))
    _write_snapshot(root / ".good2.partial-abc", _meta(image_dir))  # being committed
    (root / "corrupt").mkdir()
    (root / "corrupt" / "snapshot.json").write_text("{")
    (root / "bad-volume").mkdir()
    (root / "bad-volume" / "snapshot.json").write_text(json.dumps({"volumes": [{"name": "x"}]}))
    (root / "empty").mkdir()
    (root / "a-file").write_text("not a directory")
    assert snapshot_files.recorded_volumes(root) == {
        "good": (VOLUME,),
        ".good2.partial-abc": (VOLUME,),
    }
    assert snapshot_files.recorded_volumes(tmp_path / "missing") == {}


def test_image_users_are_found_through_both_records(tmp_path: Path, image_dir: Path) -> None:
    snaps, run = tmp_path / "snaps", tmp_path / "run"
    _write_snapshot(snaps / "t1", _meta(image_dir))
    elsewhere = ImageRef("x", "k", "/elsewhere")
    _write_snapshot(snaps / "t2", dataclasses.replace(_meta(image_dir), image=elsewhere))
    rt = RuntimePaths(run / "vm-1")
    rt.dir.mkdir(parents=True)
    runtime_meta.write(rt, _record(rt, image_dir))
    (run / "vm-2").mkdir()
    (run / "vm-2" / "vm.json").write_text("garbage")
    img = Image("python", "abc", image_dir, {})
    assert sorted(users_of(img, [snaps, run])) == ["VM vm-1", "snapshot t1"]


# ------------------------------------------------------------ vm.json


def _record(rt: RuntimePaths, image_dir: Path) -> runtime_meta.VMRecord:
    return runtime_meta.VMRecord(
        id="vm-1",
        pid=1234,
        qmp=rt.qmp,
        agent=rt.agent,
        ram_file=Path("/snaps/base/memory.bin"),
        origin_snapshot=Path("/snaps/base"),
        machine=_machine(image_dir),
        image=ImageRef("python", "abc", str(image_dir)),
        started_at_unix=1700000000.5,
        volumes=(VOLUME,),
    )


def test_vm_record_keeps_todays_keys(tmp_path: Path, image_dir: Path) -> None:
    rt = RuntimePaths(tmp_path / "vm-1")
    rt.dir.mkdir()
    record = _record(rt, image_dir)
    runtime_meta.write(rt, record)
    data = json.loads((rt.dir / "vm.json").read_text())
    assert list(data) == VM_KEYS
    assert data["qmp"] == str(rt.qmp) and data["origin_snapshot"] == "/snaps/base"
    assert runtime_meta.read(rt) == record
    (rt.dir / "vm.json").write_text("{}")
    with pytest.raises(Exception, match=r"cannot read .*vm\.json"):
        runtime_meta.read(rt)


# ------------------------------------------------------------ the writer's disk-full path


def test_disk_full_at_commit_is_storage_full_and_leaves_nothing(
    tmp_path: Path, image_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm = SimpleNamespace(
        id="vm-1",
        machine=_machine(image_dir),
        image=None,
        origin=None,
        volumes=[],
        origin_id=None,
    )
    dest = tmp_path / "snaps" / "full"
    dest.parent.mkdir()
    writer = SnapshotWriter(vm, dest)
    writer.staging.mkdir()
    (writer.staging / "vmstate").write_bytes(b"state")
    writer._mem_fd = os.open(writer.staging / "memory.bin", os.O_WRONLY | os.O_CREAT)

    def no_space(*_: object) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snapshot_files, "write_meta", no_space)
    with pytest.raises(
        StorageFull, match=f"disk full while writing snapshot full under {dest.parent}"
    ):
        asyncio.run(writer.commit(SnapshotLabels(tag="full")))
    assert list(dest.parent.iterdir()) == []
