"""The volume store on a real ext4 file system (mkfs.ext4, qemu-img), and its typed errors."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from forkd.errors import Conflict, ForkdError, Invalid, NotFound
from forkd.vmm import volumes
from forkd.vmm.volumes import (
    MIN_SIZE,
    Attachment,
    VolumeStore,
    attach_for_boot,
    attach_for_fork,
    check_guest_mount,
    own_layer,
    parse_size,
)

needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4")
needs_qemu_img = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    return VolumeStore(tmp_path / "volumes")


def _tar(tmp_path: Path, files: dict[str, bytes]) -> Path:
    path = tmp_path / "content.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# ------------------------------------------------------------ input checks


@pytest.mark.parametrize(
    ("text", "size"),
    [("1G", 1 << 30), ("512M", 512 << 20), ("16MiB", 16 << 20), ("300000000", 300000000),
     (" 2 g ", 2 << 30), (4096, 4096)],
)  # fmt: skip
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1.5G", "-1M", "ten", "1P"])
def test_unreadable_sizes_are_invalid(text: str) -> None:
    with pytest.raises(Invalid, match="cannot read size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("path", "message"),
    [("data", "absolute path below /"), ("/", "absolute path below /"),
     ("/a/../etc", "absolute path below /"), ("/a b", "only letters, digits"),
     ("/a;rm", "only letters, digits")],
)  # fmt: skip
def test_bad_mount_points_are_invalid(path: str, message: str) -> None:
    with pytest.raises(Invalid, match=message):
        check_guest_mount(path)


def test_mount_point_loses_its_trailing_slash() -> None:
    assert check_guest_mount("/data/") == "/data"


def test_bad_names_and_sizes_are_invalid(store: VolumeStore) -> None:
    with pytest.raises(Invalid, match="invalid volume name"):
        store.get("../etc")
    with pytest.raises(Invalid, match="invalid volume name"):
        store.create("a" * 65, MIN_SIZE)
    with pytest.raises(Invalid, match="size must be between 16 MiB and 1 TiB"):
        store.create("small", MIN_SIZE - 1)
    assert list(store.root.iterdir()) == []


def test_unknown_volumes_are_not_found(store: VolumeStore) -> None:
    for call in (store.get, store.remove, store.base):
        with pytest.raises(NotFound, match="volume 'nope' not found"):
            call("nope")
    assert not store.exists("nope")


# ------------------------------------------------------------ a real store


@needs_mkfs
def test_create_list_get_remove(store: VolumeStore, tmp_path: Path) -> None:
    info = store.create("data", MIN_SIZE, _tar(tmp_path, {"hello.txt": b"hi\n"}))
    assert info["name"] == "data" and info["size_bytes"] == MIN_SIZE
    assert info["layers"] == 0 and info["allocated_bytes"] > 0
    base = store.base("data")
    assert base.stat().st_size == MIN_SIZE
    assert base.stat().st_blocks * 512 < MIN_SIZE  # sparse
    assert store.exists("data")
    assert [v["name"] for v in store.list()] == ["data"]
    store.remove("data")
    assert not store.exists("data")
    assert list(store.root.iterdir()) == []  # no trash or staging left


@needs_mkfs
def test_an_existing_name_is_a_conflict(store: VolumeStore) -> None:
    store.create("data", MIN_SIZE)
    with pytest.raises(Conflict, match="volume 'data' already exists"):
        store.create("data", MIN_SIZE)


@needs_mkfs
def test_a_bad_archive_is_invalid_and_leaves_nothing(store: VolumeStore, tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar archive" * 100)
    with pytest.raises(Invalid, match="not a usable tar archive"):
        store.create("data", MIN_SIZE, junk)
    escaping = _tar(tmp_path, {"../outside.txt": b"x"})  # refused by the "data" filter
    with pytest.raises(Invalid, match="not a usable tar archive"):
        store.create("data", MIN_SIZE, escaping)
    assert list(store.root.iterdir()) == []
    assert not (store.root.parent / "outside.txt").exists()


@needs_mkfs
@needs_qemu_img
def test_layers_over_a_volume_and_their_collection(store: VolumeStore) -> None:
    store.create("data", MIN_SIZE)
    base = str(store.base("data"))
    ro = attach_for_boot(store, "data", "/data", readonly=True)
    assert ro == Attachment("data", "/data", True, (base,))
    assert own_layer(ro) is None and attach_for_fork(ro) is ro

    tpl = attach_for_boot(store, "data", "/data/", readonly=False)
    assert tpl.path == "/data" and tpl.chain[1:] == (base,) and tpl.format == "qcow2"
    assert tpl.top.is_file() and tpl.top.parent == store.root / "data" / "layers"
    child = attach_for_fork(tpl)
    assert child.chain[1:] == tpl.chain and child.top.is_file()
    assert own_layer(child) == child.top
    assert store.get("data")["layers"] == 2

    assert store.collect(in_use=set(child.chain)) == 0
    assert store.collect(in_use=set(tpl.chain)) == 1  # the child's layer
    assert not child.top.exists() and tpl.top.exists()


@needs_qemu_img
def test_a_layer_that_cannot_be_made_is_a_server_error(tmp_path: Path) -> None:
    missing = tmp_path / "vol" / "base.img"
    (tmp_path / "vol" / "layers").mkdir(parents=True)
    with pytest.raises(volumes.LayerError, match="cannot create a volume layer") as info:
        volumes.new_layer((str(missing),))
    # A failure of the host, not of the request: none of the 4xx kinds.
    assert isinstance(info.value, ForkdError)
    assert not isinstance(info.value, Invalid | NotFound | Conflict)
