"""A volume's files from the host side (E2B's content API below HTTP): a write is whole
or absent, a listing is bounded, what a guest made is described as the guest sees it
and nothing leads a walk out of the volume."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.controller.e2b import volume_files
from forkd.controller.e2b.volume_files import VolumeFiles, owner_of
from forkd.errors import Conflict, Invalid, NotFound

ROOT = owner_of(None, None, None, 0o644)


@pytest.fixture
def files(tmp_path: Path) -> VolumeFiles:
    data = tmp_path / "data"
    data.mkdir()
    return VolumeFiles(data)


def test_a_write_that_fails_half_way_leaves_nothing(files: VolumeFiles) -> None:
    files.write("/keep.txt", iter([b"old"]), ROOT)

    def broken() -> Iterator[bytes]:
        yield b"new half"
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        files.write("/keep.txt", broken(), ROOT)
    assert (files.root / "keep.txt").read_bytes() == b"old"
    assert sorted(p.name for p in files.root.iterdir()) == ["keep.txt"]  # no staging left


def test_made_entries_are_open_to_every_qemu_user_and_owned_as_asked(files: VolumeFiles) -> None:
    owner = owner_of(1000, 100, 0o700, 0o755)
    files.make_dir("/a/b", owner, force=True)
    host = os.stat(files.root / "a" / "b")
    assert stat.S_IMODE(host.st_mode) == 0o777  # QEMU's users all read and write it
    attrs = os.getxattr(files.root / "a" / "b", volume_files.XATTR_MODE)
    assert struct.unpack("<I", attrs)[0] == stat.S_IFDIR | 0o700
    entry = files.stat("/a/b")
    assert (entry["type"], entry["uid"], entry["gid"], entry["mode"]) == (
        "directory",
        1000,
        100,
        0o700,
    )
    with pytest.raises(Conflict):
        files.make_dir("/a/b", owner, force=False)
    files.make_dir("/a/b", owner, force=True)  # force: an existing directory is fine


def test_listings_are_bounded(files: VolumeFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(volume_files, "MAX_LISTED", 5)
    for i in range(6):
        files.write(f"/f{i}", iter([b"x"]), ROOT)
    with pytest.raises(Invalid, match="more than 5"):
        files.listing("/")
    with pytest.raises(Invalid, match="depth"):
        files.listing("/", depth=17)


@pytest.mark.parametrize("path", ["../x", "/a/../../x", "a\0b", "/" + "a/" * 65])
def test_paths_that_cannot_name_a_file_in_the_volume(files: VolumeFiles, path: str) -> None:
    with pytest.raises(Invalid):
        files.stat(path)


def test_no_host_link_is_followed(files: VolumeFiles, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host")
    (files.root / "dir-link").symlink_to(outside)
    (files.root / "file-link").symlink_to(outside / "secret")
    with pytest.raises(Invalid):
        files.listing("/dir-link")
    with pytest.raises(Invalid):
        files.write("/dir-link/new", iter([b"x"]), ROOT)
    with pytest.raises(Invalid):
        files.file_size("/file-link")
    assert not (outside / "new").exists()
    files.remove("/dir-link")  # the link goes, never what it points at
    assert (outside / "secret").read_text() == "host"


def test_a_removed_path_is_gone_and_a_missing_one_is_404(files: VolumeFiles) -> None:
    files.write("/d/e/f", iter([b"x"]), ROOT)
    files.remove("/d")
    assert list(files.root.iterdir()) == []
    with pytest.raises(NotFound):
        files.remove("/d")
    with pytest.raises(Invalid):
        files.remove("/")


def test_a_tree_deeper_than_any_recursion_is_removed(files: VolumeFiles) -> None:
    fd = os.open(files.root, os.O_RDONLY)
    try:  # 1,500 levels, as a guest could make them (a path this long cannot be named)
        for _ in range(1500):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=child), "w") as f:
                f.write("x")
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    files.remove("/d")
    assert list(files.root.iterdir()) == []


def test_a_huge_directory_is_refused_before_it_is_read_whole(
    files: VolumeFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(volume_files, "MAX_LISTED", 50)
    for i in range(60):  # hidden staging names count too: they cost as much to read
        (files.root / f"{volume_files.STAGING_PREFIX}{i}").write_bytes(b"")
    with pytest.raises(Invalid, match="more than 50"):
        files.listing("/")
