"""The volume store on a real ext4 file system (mkfs.ext4, qemu-img), and its typed errors."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.archive import unpack as archive_unpack
from forkd.archive.tar_format import Member
from forkd.client import Controller
from forkd.controller.settings import Settings
from forkd.disk_reserve import free_bytes
from forkd.errors import Conflict, ForkdError, Invalid, NoRoom, NotFound, StorageFull
from forkd.vmm.volumes import disks as volumes
from forkd.vmm.volumes.disks import (
    MIN_SIZE,
    Attachment,
    VolumeStore,
    attach_for_boot,
    attach_for_fork,
    check_guest_mount,
    own_layer,
    parse_size,
)
from tests.unit.conftest import RecordingTransport, Server

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
    [
        ("1G", 1 << 30),
        ("512M", 512 << 20),
        ("16MiB", 16 << 20),
        ("300000000", 300000000),
        (" 2 g ", 2 << 30),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1.5G", "-1M", "ten", "1P"])
def test_unreadable_sizes_are_invalid(text: str) -> None:
    with pytest.raises(Invalid, match="cannot read size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("data", "absolute path below /"),
        ("/", "absolute path below /"),
        ("/a/../etc", "absolute path below /"),
        ("/a b", "only letters, digits"),
        ("/a;rm", "only letters, digits"),
    ],
)
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


# ------------------------------------------------------------ hostile archives


class _Zeros:
    """A file of zeros that is never held in memory whole."""

    def read(self, n: int = -1) -> bytes:
        return bytes(n if n >= 0 else 0)


def _archive(entries: dict[str, int | bytes], gz: bool = True, **tar_kw: Any) -> bytes:
    """A tar (gzip-compressed when ``gz``) of files given as bytes or as a count of zeros."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", **tar_kw) as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if isinstance(data, bytes):
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.size = data
                tar.addfile(info, _Zeros())
    return buf.getvalue()


def _cat(base: Path, path: str) -> bytes:
    """A file's bytes inside an ext4 image, read by debugfs (no mount needed)."""
    out = subprocess.run(
        ["debugfs", "-R", f"cat {path}", str(base)], capture_output=True, check=True
    )
    return out.stdout


@pytest.fixture
def unpacked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the files the store writes while unpacking, in order."""
    written: list[int] = []
    write_file = archive_unpack._Unpacker._file

    def spy(self: archive_unpack._Unpacker, parent: int, name: str, member: Member) -> None:
        written.append(member.size)
        write_file(self, parent, name, member)

    monkeypatch.setattr(archive_unpack._Unpacker, "_file", spy)
    # Seen only in this process: the same extractor, not in its unprivileged child.
    monkeypatch.setattr("forkd.vmm.jail.archive.qemu_user.reserve", lambda: None)
    return written


needs_debugfs = pytest.mark.skipif(shutil.which("debugfs") is None, reason="needs debugfs")


@needs_mkfs
@needs_debugfs
@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_a_tar_or_tar_gz_fills_the_volume(store: VolumeStore, gz: bool) -> None:
    """Told apart by the archive's first bytes: no name, no header says which."""
    content = _archive({"hello.txt": b"hi\n", "sub/zeros.bin": 1 << 20}, gz=gz)
    assert content[:2] == (b"\x1f\x8b" if gz else b"he")
    store.create("data", MIN_SIZE, content)
    base = store.base("data")
    assert _cat(base, "/hello.txt") == b"hi\n"
    assert _cat(base, "/sub/zeros.bin") == bytes(1 << 20)


@needs_mkfs
def test_a_gzip_bomb_is_refused_before_it_passes_the_volume_size(
    store: VolumeStore, tmp_path: Path, unpacked: list[int]
) -> None:
    bomb = _archive({"zeros.bin": 64 << 20})  # 64 MiB of zeros
    assert len(bomb) < 100 << 10  # in under 100 KiB
    bomb_file = tmp_path / "bomb.tar"  # the name says nothing of the gzip inside
    bomb_file.write_bytes(bomb)
    with pytest.raises(Invalid, match="too large for a volume of 16777216 bytes"):
        store.create("data", MIN_SIZE, bomb_file)
    assert unpacked == []  # refused on its header, before a byte was written
    assert list(store.root.iterdir()) == []


@needs_mkfs
def test_a_bomb_of_many_files_stops_at_the_volume_size(
    store: VolumeStore, unpacked: list[int]
) -> None:
    bomb = _archive({f"f{i:03}.bin": 1 << 20 for i in range(300)})  # 300 MiB
    with pytest.raises(Invalid, match="too large for a volume of"):
        store.create("data", MIN_SIZE, bomb)
    assert sum(unpacked) <= MIN_SIZE and len(unpacked) == 16
    assert list(store.root.iterdir()) == []


@needs_mkfs
def test_too_many_entries_are_refused_at_the_count(store: VolumeStore, unpacked: list[int]) -> None:
    most = volumes.max_entries(MIN_SIZE)
    assert most == MIN_SIZE // 4096
    many = _archive({f"d/e{i}": b"" for i in range(most + 50)})  # "d" is implied, not an entry
    with pytest.raises(Invalid, match=f"more than {most} entries"):
        store.create("data", MIN_SIZE, many)
    assert len(unpacked) == most
    assert list(store.root.iterdir()) == []
    store.create("data", MIN_SIZE, _archive({f"e{i}": b"" for i in range(200)}))


@needs_mkfs
def test_a_huge_pax_header_is_refused_without_reading_it(store: VolumeStore) -> None:
    """tarfile reads a pax or long-name header's payload whole into memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("././@PaxHeader")
        info.type = tarfile.XHDTYPE
        info.size = 2 << 20
        tar.addfile(info, _Zeros())
    with pytest.raises(Invalid, match="2097152-byte extended header"):
        store.create("data", MIN_SIZE, buf.getvalue())
    assert list(store.root.iterdir()) == []


@needs_mkfs
def test_tar_stream_past_what_the_volume_could_hold_is_refused(store: VolumeStore) -> None:
    """Headers that are not files (global pax records) still count as tar read."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for _ in range(40):  # 40 MiB of global headers, none a member
            info = tarfile.TarInfo("pax_global_header")
            info.type = tarfile.XGLTYPE
            info.size = 1 << 20
            record = b"%d x=%s\n" % (1 << 20, b"y" * ((1 << 20) - 11))  # its length first
            tar.addfile(info, io.BytesIO(record))
    with pytest.raises(Invalid, match=r"more than \d+ extended headers|longer than \d+ bytes"):
        store.create("data", MIN_SIZE, buf.getvalue())
    assert list(store.root.iterdir()) == []


@needs_mkfs
@pytest.mark.parametrize(
    "content",
    [b"\x1f\x8b\x08\x00" + b"garbage" * 100, _archive({"a": b"x"})[:40], b"\x1f\x8b"],
    ids=["bad-gzip", "truncated-gzip", "magic-only"],
)
def test_broken_gzip_is_a_bad_archive(store: VolumeStore, content: bytes) -> None:
    with pytest.raises(Invalid, match="not a usable tar archive"):
        store.create("data", MIN_SIZE, content)
    assert list(store.root.iterdir()) == []


def _special(name: str, kind: bytes, linkname: str = "") -> bytes:
    """A tar.gz of one link or device entry."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, linkname
        tar.addfile(info)
    return buf.getvalue()


@needs_mkfs
@pytest.mark.parametrize(
    "content",
    [
        _archive({"../outside.txt": b"x"}),
        _special("passwd", tarfile.SYMTYPE, "/etc/passwd"),
        _special("up", tarfile.SYMTYPE, "../../../etc"),
        _special("shadow", tarfile.LNKTYPE, "/etc/shadow"),
        _special("sda", tarfile.BLKTYPE),
    ],
    ids=["dotdot", "absolute-symlink", "escaping-symlink", "hardlink-out", "device"],
)
def test_the_data_filter_still_holds_inside_gzip(store: VolumeStore, content: bytes) -> None:
    with pytest.raises(Invalid, match="not a usable tar archive"):
        store.create("data", MIN_SIZE, content)
    assert list(store.root.iterdir()) == []
    assert not (store.root.parent / "outside.txt").exists()


# ------------------------------------------------------------ the host's free space


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs: a real file system that fills up (needs root)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@needs_mkfs
def test_a_volume_larger_than_the_free_space_is_refused_first(small_disk: Path) -> None:
    store = VolumeStore(small_disk / "volumes")
    fits = r"a volume of 32 MiB does not fit: the host's disk has 2\d MiB free"
    with pytest.raises(NoRoom, match=fits):
        store.create("data", 32 << 20, _archive({"a": b"x"}))
    assert list(store.root.iterdir()) == []
    store.create("fits", MIN_SIZE)  # 16 MiB of 24: fits


@needs_mkfs
def test_a_volume_must_fit_beside_its_unpacked_content(small_disk: Path) -> None:
    store = VolumeStore(small_disk / "volumes")
    with pytest.raises(NoRoom, match="does not fit next to its unpacked content"):
        store.create("data", MIN_SIZE, _archive({"zeros.bin": 12 << 20}))
    assert list(store.root.iterdir()) == []


@needs_mkfs
def test_a_disk_that_fills_while_unpacking_is_storage_full(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free-space check passed, then the disk filled (another writer, say)."""
    store = VolumeStore(small_disk / "volumes")
    (small_disk / "other-writer").write_bytes(bytes(12 << 20))
    monkeypatch.setattr(volumes, "free_bytes", lambda _d: 1 << 40)  # the check saw room
    with pytest.raises(StorageFull, match="filled up while unpacking"):
        store.create("data", MIN_SIZE, _archive({"zeros.bin": 15 << 20}))
    assert list(store.root.iterdir()) == []


# ------------------------------------------------------------ over HTTP


@needs_mkfs
@needs_debugfs
def test_the_sdk_uploads_a_directory_gzipped(
    server: Server, sent: RecordingTransport, settings: Settings, tmp_path: Path
) -> None:
    src = tmp_path / "dataset"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "b.csv").write_text("1,2\n" * 10_000)
    with Controller(server.url, token=server.token, transport=sent) as ctl:
        info = ctl.create_volume("data", "16M", from_dir=src)
    assert info["name"] == "data"
    body = sent.last.content
    assert body[:2] == b"\x1f\x8b" and len(body) < 5_000  # 40 KB of CSV, compressed
    base = settings.state_dir / "volumes" / "data" / "base.img"
    assert _cat(base, "/a.txt") == b"alpha\n"
    assert _cat(base, "/sub/b.csv") == b"1,2\n" * 10_000


@needs_mkfs
def test_a_bomb_over_http_is_a_400_and_leaves_nothing(server: Server, settings: Settings) -> None:
    bomb = _archive({"zeros.bin": 64 << 20})
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/x-tar"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        r = c.post("/v1/volumes", params={"name": "data", "size": "16M"}, content=bomb)
        assert r.status_code == 400, r.text
        assert "too large for a volume of" in r.json()["error"]
        assert c.get("/v1/volumes").json() == []
        if free_bytes(settings.state_dir) < 1 << 40:  # as on any test machine
            r = c.post("/v1/volumes", params={"name": "big", "size": "1T"})
            assert r.status_code == 507 and "does not fit" in r.json()["error"], r.text
    assert list((settings.state_dir / "volumes").iterdir()) == []
