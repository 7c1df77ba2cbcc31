"""E2B's volumes through E2B's own SDK, against forkd's E2B port with fake VMs: a volume
is made, listed, found and destroyed; a sandbox created with ``volume_mounts`` is given
the volume's directory in a share slot (its QEMU started for it, not taken from the
pool), mounted where asked; a mounted volume cannot be destroyed; a snapshot of the
sandbox mounts it in every sandbox made from it. (The real ext4 disks, 9p and guests:
tests/integration/test_e2b_volumes.py.)"""

from __future__ import annotations

import asyncio
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import e2b
import pytest

from forkd.errors import Unavailable
from forkd.vmm.volumes.share_disks import ShareDisks
from forkd.vmm.volumes.shares import Share
from tests.unit.conftest import Server


@pytest.fixture(autouse=True)
def plain_disks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Volumes as plain directories: no mkfs, no loop mount, for tests of the API."""

    def create(self: ShareDisks, volume_id: str, size_bytes: int) -> Path:
        data = self.data_dir(volume_id)
        data.mkdir(parents=True)
        return data

    monkeypatch.setattr(ShareDisks, "create", create)
    monkeypatch.setattr(ShareDisks, "mount", lambda self, volume_id: self.data_dir(volume_id))
    monkeypatch.setattr(ShareDisks, "unmount", lambda self, volume_id, lazily=False: None)
    monkeypatch.setattr(ShareDisks, "mounted_data", ShareDisks.data_dir)
    yield


def shares_given(server: Server) -> list[Share]:
    given = server.driver.restore_kwargs[-1].get("shares") or []
    return list(given)


def test_a_volume_is_made_listed_found_and_destroyed(server: Server, e2b_url: str) -> None:
    vol = e2b.Volume.create("team-data")
    assert vol.volume_id.startswith("vol-") and vol.name == "team-data" and vol.token
    assert [(v.volume_id, v.name) for v in e2b.Volume.list()] == [(vol.volume_id, "team-data")]
    found = e2b.Volume.connect(vol.volume_id)
    assert (found.name, found.token) == ("team-data", vol.token)
    with pytest.raises(e2b.VolumeException):  # one name, one volume
        e2b.Volume.create("team-data")
    for bad in ("no spaces/or slashes", "vol-0123456789abcdef"):  # nor an id's form
        with pytest.raises(e2b.VolumeException):
            e2b.Volume.create(bad)
    assert e2b.Volume.destroy(vol.volume_id) is True
    assert e2b.Volume.destroy(vol.volume_id) is False  # gone: 404
    with pytest.raises(e2b.NotFoundException):
        e2b.Volume.get_info(vol.volume_id)
    assert e2b.Volume.list() == []


def test_a_sandbox_mounts_volumes_where_asked(server: Server, e2b_url: str) -> None:
    vol = e2b.Volume.create("shared")
    other = e2b.Volume.create("other")
    sbx = e2b.Sandbox.create("base", volume_mounts={"/mnt/shared": vol, "/data//x/": "other"})
    shares = shares_given(server)
    assert [(s.slot, s.guest_path, s.name) for s in shares] == [
        (0, "/mnt/shared", "shared"),
        (1, "/data/x", "other"),
    ]
    assert shares[0].host_dir.parent.name == vol.volume_id
    assert shares[1].host_dir.parent.name == other.volume_id
    with pytest.raises(e2b.VolumeException, match="mounted by"):  # in use: kept
        e2b.Volume.destroy(vol.volume_id)
    # A snapshot mounts what its source mounted, in every sandbox made from it.
    sbx.create_snapshot(name="with-volume")
    again = e2b.Sandbox.create("with-volume")
    assert [(s.guest_path, s.name) for s in shares_given(server)] == [
        ("/mnt/shared", "shared"),
        ("/data/x", "other"),
    ]
    again.kill()
    sbx.kill()
    assert e2b.Volume.destroy(vol.volume_id) is True
    # The snapshot forks on without the destroyed volume.
    e2b.Sandbox.create("with-volume").kill()
    assert [s.name for s in shares_given(server)] == ["other"]


@pytest.mark.parametrize(
    ("mounts", "error"),
    [
        ({"/mnt/x": "no-such-volume"}, "404: no volume"),
        ({"relative/path": "v"}, "400: a volume's mount path must be absolute"),
        ({"/proc/x": "v"}, "400: a volume cannot be mounted at '/proc/x'"),
        ({f"/m{i}": "v" for i in range(3)}, "400: .*at most 2"),  # two share slots
    ],
)
def test_a_bad_mount_makes_no_sandbox(
    server: Server, e2b_url: str, mounts: dict[str, e2b.Volume | str], error: str
) -> None:
    e2b.Volume.create("v")
    with pytest.raises(e2b.SandboxException, match=error):
        e2b.Sandbox.create("base", volume_mounts=mounts)
    assert e2b.Sandbox.list().next_items() == []
    assert server.driver.restore_kwargs == []


def test_volumes_need_the_api_key(server: Server, e2b_url: str) -> None:
    with pytest.raises(e2b.AuthenticationException):
        e2b.Volume.create("nope", api_key="e2b_" + "0" * 40)
    assert e2b.Volume.list() == []


@pytest.fixture
def content_env(e2b_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("E2B_VOLUME_API_URL", e2b_url)
    return e2b_url


def test_a_volumes_files_through_its_content_api(server: Server, content_env: str) -> None:
    vol = e2b.Volume.create("content")
    made = vol.make_dir("/notes")
    assert (made.name, made.type.value, made.path, made.mode, made.uid) == (
        "notes",
        "directory",
        "/notes",
        0o755,
        0,
    )
    wrote = vol.write_file("/notes/a.txt", "hello volume", uid=1000, gid=1000, mode=0o600)
    assert (wrote.type.value, wrote.size, wrote.uid, wrote.gid, wrote.mode) == (
        "file",
        12,
        1000,
        1000,
        0o600,
    )
    assert vol.read_file("/notes/a.txt") == "hello volume"
    big = bytes(range(256)) * 8192  # 2 MiB: more than one chunk each way
    vol.write_file("/deep/er/big.bin", big, force=True)  # force: its parents made
    assert vol.read_file("/deep/er/big.bin", format="bytes") == big
    assert b"".join(vol.read_file("/deep/er/big.bin", format="stream")) == big
    assert [e.path for e in vol.list("/", depth=3)] == [
        "/deep",
        "/deep/er",
        "/deep/er/big.bin",
        "/notes",
        "/notes/a.txt",
    ]
    assert [e.name for e in vol.list("/notes")] == ["a.txt"]
    changed = vol.update_metadata("/notes/a.txt", mode=0o640)
    assert (changed.mode, changed.uid) == (0o640, 1000)  # what was not asked is kept
    assert vol.exists("/notes/a.txt") and not vol.exists("/notes/missing")
    with pytest.raises(e2b.NotFoundException):
        vol.read_file("/notes/missing")
    with pytest.raises(e2b.NotFoundException):  # no force: the parent must exist
        vol.make_dir("/nowhere/x")
    vol.write_file("/made/on/the/way.txt", "x")  # a write makes its parents
    assert vol.get_info("/made/on").type.value == "directory"
    vol.remove("/made")
    vol.remove("/deep")
    assert [e.path for e in vol.list("/")] == ["/notes"]
    with pytest.raises(e2b.NotFoundException):
        vol.remove("/deep")
    # The files are where a sandbox mounting the volume sees them, with the owner and
    # mode it will see (QEMU's attributes).
    data = server.app.state.services.shared_volumes.data_dir(
        server.app.state.services.shared_volumes.get(vol.volume_id)
    )
    assert (data / "notes" / "a.txt").read_text() == "hello volume"
    assert os.getxattr(data / "notes" / "a.txt", "user.virtfs.uid") == struct.pack("<I", 1000)


def test_a_guest_made_link_is_reported_never_followed(server: Server, content_env: str) -> None:
    vol = e2b.Volume.create("hostile")
    data = server.app.state.services.shared_volumes.data_dir(
        server.app.state.services.shared_volumes.get(vol.volume_id)
    )
    # As QEMU stores a guest's symbolic link: a plain file holding the target.
    link = data / "escape"
    link.write_text("/etc/shadow")
    os.setxattr(link, "user.virtfs.mode", struct.pack("<I", stat.S_IFLNK | 0o777))
    info = vol.get_info("/escape")
    assert (info.type.value, info.target) == ("symlink", "/etc/shadow")
    with pytest.raises(e2b.VolumeException, match="symlink, not a file"):
        vol.read_file("/escape")
    # A real host link (which no guest can make) is not followed either.
    (data / "hostlink").symlink_to("/etc")
    with pytest.raises(e2b.VolumeException):
        vol.list("/hostlink")
    with pytest.raises(e2b.VolumeException):
        vol.read_file("/hostlink/hostname")
    for bad in ("/../../etc/hostname", "a/../../b"):
        with pytest.raises(e2b.VolumeException, match=r"'\.\.'"):
            vol.read_file(bad)


def test_content_needs_the_volumes_own_token(server: Server, content_env: str) -> None:
    mine = e2b.Volume.create("mine")
    theirs = e2b.Volume.create("theirs")
    theirs.write_file("/secret.txt", "not yours")
    with pytest.raises(e2b.AuthenticationException):
        e2b.Volume(theirs.volume_id, "theirs", token=mine.token).read_file("/secret.txt")
    with pytest.raises(e2b.AuthenticationException):
        e2b.Volume(theirs.volume_id, "theirs", token="").list("/")
    with pytest.raises(e2b.AuthenticationException):  # the API key is not a volume token
        e2b.Volume(theirs.volume_id, "theirs", token=server.token).list("/")
    e2b.Volume.destroy(theirs.volume_id)
    with pytest.raises(e2b.AuthenticationException):  # gone: its token with it
        theirs.list("/")


def test_the_async_sdk_makes_mounts_and_fills_a_volume(server: Server, content_env: str) -> None:
    async def run() -> tuple[str, list[str], bool]:
        vol = await e2b.AsyncVolume.create("async-vol")
        sbx = await e2b.AsyncSandbox.create("base", volume_mounts={"/mnt/async": vol})
        await vol.write_file("/from-async.txt", b"async bytes")
        text = await vol.read_file("/from-async.txt")
        names = [e.name for e in await vol.list("/")]
        await sbx.kill()
        return text, names, await e2b.AsyncVolume.destroy(vol.volume_id)

    assert asyncio.run(run()) == ("async bytes", ["from-async.txt"], True)
    assert [(s.guest_path, s.name) for s in shares_given(server)] == [("/mnt/async", "async-vol")]


def test_a_branch_is_taken_while_a_volume_is_not_mounted_on_the_host(
    server: Server, e2b_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx = e2b.Sandbox.create("base", volume_mounts={"/mnt/v": e2b.Volume.create("unmounted")})

    def unmounted(self: ShareDisks, volume_id: str) -> Path:
        raise Unavailable(f"volume {volume_id} is not mounted")

    monkeypatch.setattr(ShareDisks, "mounted_data", unmounted)
    sbx.create_snapshot(name="while-unmounted")  # the record is copied, no disk is asked
    with pytest.raises(e2b.ServiceBusyException, match="not mounted"):  # 503: forks need it
        e2b.Sandbox.create("while-unmounted")
    monkeypatch.setattr(ShareDisks, "mounted_data", ShareDisks.data_dir)
    e2b.Sandbox.create("while-unmounted").kill()
    assert [s.guest_path for s in shares_given(server)] == ["/mnt/v"]
    sbx.kill()
