"""The guest agent's chunked transfers (forkd_files.py), run on the host against tmp dirs:
staged uploads and their atomic commit, aborts, a full disk, the bounds on open
transfers, ranged reads, and tar streams that never write outside their directory."""

from __future__ import annotations

import base64
import errno
import importlib.util
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from forkd.archive import unpack as archive_unpack

FILES = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files"


def _load(name: str, file: str) -> ModuleType:
    if str(FILES) not in sys.path:
        sys.path.insert(0, str(FILES))
    spec = importlib.util.spec_from_file_location(name, FILES / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ff = _load("forkd_files_under_test", "forkd_files.py")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh table behind the ops, on a clock the test moves."""
    clock = Clock()
    t = ff.TransferTable(max_open=4, idle_secs=60.0, clock=clock)
    t.clock = clock
    monkeypatch.setattr(ff, "TRANSFERS", t)
    yield t
    t.sweep()


def _read(op: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The answer of a read op, which comes pre-encoded, as the host parses it."""
    result = op(params)
    assert isinstance(result, ff.EncodedJSON)
    answer: dict[str, Any] = json.loads(b"".join(result))
    return answer


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _upload(path: Path, *chunks: bytes, **open_params: Any) -> str:
    tid = ff.op_file_upload_open({"path": str(path), **open_params})["transfer_id"]
    offset = 0
    for chunk in chunks:
        ff.op_file_upload_write({"transfer_id": tid, "offset": offset, "data": _b64(chunk)})
        offset += len(chunk)
    return tid


def _staged(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(ff.STAGED_PREFIX)]


# ------------------------------------------------------------ uploads


def test_an_upload_lands_whole_at_the_commit_and_not_before(table: Any, tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    tid = _upload(target, b"a" * 1000, b"b" * 24)
    assert target.read_bytes() == b"old"  # a reader still sees the old file
    assert len(_staged(tmp_path)) == 1
    answer = ff.op_file_upload_commit({"transfer_id": tid})
    assert answer == {"path": str(target), "size": 1024}
    assert target.read_bytes() == b"a" * 1000 + b"b" * 24
    assert _staged(tmp_path) == [] and len(table) == 0


def test_modes_kept_given_or_0644_whatever_the_umask(table: Any, tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        (tmp_path / "x").write_text("")
        (tmp_path / "x").chmod(0o750)
        ff.op_file_upload_commit({"transfer_id": _upload(tmp_path / "x", b"1")})
        ff.op_file_upload_commit({"transfer_id": _upload(tmp_path / "new", b"2")})
        ff.op_file_upload_commit({"transfer_id": _upload(tmp_path / "m", b"3", mode=0o600)})
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("x", "new", "m")}
    assert modes == {"x": 0o750, "new": 0o644, "m": 0o600}


def test_a_symlink_target_is_written_through(table: Any, tmp_path: Path) -> None:
    (tmp_path / "real").write_text("old")
    (tmp_path / "link").symlink_to("real")
    ff.op_file_upload_commit({"transfer_id": _upload(tmp_path / "link", b"new")})
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real").read_text() == "new"


def test_parents_are_made_and_a_directory_is_refused(table: Any, tmp_path: Path) -> None:
    ff.op_file_upload_commit({"transfer_id": _upload(tmp_path / "a" / "b" / "c", b"x")})
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"x"
    with pytest.raises(IsADirectoryError):
        ff.op_file_upload_open({"path": str(tmp_path / "a")})
    assert len(table) == 0


def test_abort_removes_the_staged_file(table: Any, tmp_path: Path) -> None:
    tid = _upload(tmp_path / "f", b"data")
    assert ff.op_file_transfer_abort({"transfer_id": tid}) == {"aborted": True}
    assert os.listdir(tmp_path) == []
    assert ff.op_file_transfer_abort({"transfer_id": tid}) == {"aborted": False}
    with pytest.raises(ff.TransferGone):
        ff.op_file_upload_commit({"transfer_id": tid})


def test_a_chunk_at_the_wrong_offset_drops_the_upload(table: Any, tmp_path: Path) -> None:
    tid = _upload(tmp_path / "f", b"abc")
    with pytest.raises(ValueError, match="offset"):
        ff.op_file_upload_write({"transfer_id": tid, "offset": 0, "data": _b64(b"again")})
    assert os.listdir(tmp_path) == [] and len(table) == 0


@pytest.mark.parametrize(
    "params",
    [
        {"data": "not base64!"},
        {"data": _b64(b"x" * (ff.MAX_CHUNK_BYTES + 1))},
        {"data": _b64(b"x"), "offset": -1},
        {"data": _b64(b"x"), "offset": True},
    ],
)
def test_bad_chunks_are_refused(table: Any, tmp_path: Path, params: dict[str, Any]) -> None:
    tid = _upload(tmp_path / "f")
    with pytest.raises(ValueError):
        ff.op_file_upload_write({"transfer_id": tid, "offset": 0, **params})


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_removes_the_staged_file(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int
) -> None:
    (tmp_path / "f").write_text("old")
    tid = _upload(tmp_path / "f", b"first")

    def full(fd: int, data: Any) -> int:
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(ff.os, "write", full)
    with pytest.raises(ff.NoSpaceError, match="disk is full"):
        ff.op_file_upload_write({"transfer_id": tid, "offset": 5, "data": _b64(b"more")})
    assert os.listdir(tmp_path) == ["f"] and (tmp_path / "f").read_text() == "old"
    assert len(table) == 0


def test_a_full_disk_at_the_fsync_too(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = _upload(tmp_path / "f", b"data")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ff.os, "fsync", full)
    with pytest.raises(ff.NoSpaceError):
        ff.op_file_upload_commit({"transfer_id": tid})
    assert os.listdir(tmp_path) == []


def test_a_real_tiny_tmpfs(table: Any, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        tid = _upload(mnt / "f", b"x" * 32768)
        with pytest.raises(ff.NoSpaceError):
            ff.op_file_upload_write(
                {"transfer_id": tid, "offset": 32768, "data": _b64(b"y" * 65536)}
            )
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_open_transfers_are_bounded(table: Any, tmp_path: Path) -> None:
    for i in range(4):
        _upload(tmp_path / f"f{i}")
    with pytest.raises(BlockingIOError, match="at most 4"):
        _upload(tmp_path / "one-too-many")


def test_idle_transfers_expire_with_their_staged_files(table: Any, tmp_path: Path) -> None:
    old = _upload(tmp_path / "old", b"x")
    table.clock.now += 30
    fresh = _upload(tmp_path / "fresh", b"y")
    table.clock.now += 31  # old is idle 61 s, fresh 31 s
    assert table.sweep() == 1
    assert len(_staged(tmp_path)) == 1
    with pytest.raises(ff.TransferGone):
        ff.op_file_upload_commit({"transfer_id": old})
    ff.op_file_upload_commit({"transfer_id": fresh})
    assert os.listdir(tmp_path) == ["fresh"]


def test_expired_transfers_free_their_slots(table: Any, tmp_path: Path) -> None:
    for i in range(4):
        _upload(tmp_path / f"f{i}")
    table.clock.now += 61
    _upload(tmp_path / "after")  # the open sweeps first
    assert len(table) == 1


# ------------------------------------------------------------ ranged reads


def test_ranges_say_size_and_eof(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"0123456789")

    def read(params: dict[str, Any]) -> dict[str, Any]:
        return _read(ff.op_file_read_range, params)

    first = read({"path": str(f), "offset": 0, "length": 4})
    assert (base64.b64decode(first["data"]), first["size"], first["eof"]) == (b"0123", 10, False)
    last = read({"path": str(f), "offset": 6, "length": 4})
    assert (base64.b64decode(last["data"]), last["eof"]) == (b"6789", True)
    past = read({"path": str(f), "offset": 50, "length": 4})
    assert (past["data"], past["eof"]) == ("", True)


def test_a_proc_file_has_no_size_but_reads(tmp_path: Path) -> None:
    params = {"path": "/proc/self/status", "offset": 0, "length": 1 << 20}
    answer = _read(ff.op_file_read_range, params)
    assert answer["size"] == 0 and answer["eof"] and b"Name:" in base64.b64decode(answer["data"])


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"offset": 0, "length": 0}, ValueError),
        ({"offset": 0, "length": (1 << 20) + 1}, ValueError),
        ({"offset": -1, "length": 1}, ValueError),
        ({"path": "relative", "offset": 0, "length": 1}, ValueError),
        ({"path": "/", "offset": 0, "length": 1}, IsADirectoryError),
        ({"path": "/no/such/file", "offset": 0, "length": 1}, FileNotFoundError),
    ],
)
def test_bad_reads_are_refused(tmp_path: Path, params: dict[str, Any], error: type) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(error):
        ff.op_file_read_range({"path": str(tmp_path / "f"), **params})


# ------------------------------------------------------------ tar streams


def _tar_of(directory: Path) -> bytes:
    tid = ff.op_file_tar_open({"path": str(directory)})["transfer_id"]
    out = b""
    while True:
        answer = _read(ff.op_file_tar_read, {"transfer_id": tid, "length": 4096})
        out += base64.b64decode(answer["data"])
        if answer["eof"]:
            return out


def _untar(data: bytes, dest: Path) -> None:
    tid = _upload(dest, *(data[i : i + 5000] for i in range(0, len(data), 5000)), format="tar")
    ff.op_file_upload_commit({"transfer_id": tid})


def test_a_directory_round_trips_as_tar(table: Any, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub" / "empty").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (src / "sub" / "run.sh").chmod(0o755)
    (src / "link").symlink_to("sub/run.sh")
    data = _tar_of(src)
    assert len(table) == 0  # finished at its eof
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert sorted(tar.getnames())[:2] == [".", "./a.txt"]
    _untar(data, tmp_path / "dst")
    dst = tmp_path / "dst"
    assert (dst / "a.txt").read_text() == "alpha"
    assert stat.S_IMODE((dst / "sub" / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(dst / "link") == "sub/run.sh" and (dst / "sub" / "empty").is_dir()
    assert len(table) == 0


def test_padding_sent_after_the_archive_ended_is_taken(table: Any, tmp_path: Path) -> None:
    """A tar's end marker is followed by padding the sender may write after the
    extractor has finished; those writes must not fail with a broken pipe."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("alpha")
    data = _tar_of(tmp_path / "src")
    tid = _upload(tmp_path / "dst", data, format="tar")
    time.sleep(0.3)  # the extractor has read the end marker by now
    padding = bytes(64 * 1024)
    ff.op_file_upload_write({"transfer_id": tid, "offset": len(data), "data": _b64(padding)})
    ff.op_file_upload_commit({"transfer_id": tid})
    assert (tmp_path / "dst" / "a.txt").read_text() == "alpha"
    assert len(table) == 0


def test_what_is_not_a_tar_archive_is_refused(table: Any, tmp_path: Path) -> None:
    with pytest.raises(ff.BadArchiveError):
        _untar(b"this is not a tar archive" * 100, tmp_path / "d")
    with pytest.raises(ff.BadArchiveError):
        _untar(_archive(_file("a"), _file("b"))[:700], tmp_path / "d")  # cut in a member
    assert len(table) == 0


def test_tar_of_a_file_or_nothing_is_refused(table: Any, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        ff.op_file_tar_open({"path": str(tmp_path / "f")})
    with pytest.raises(FileNotFoundError):
        ff.op_file_tar_open({"path": str(tmp_path / "none")})
    assert len(table) == 0


def _archive(*members: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
    return buf.getvalue()


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 1
    return info


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    return info


@pytest.mark.parametrize(
    "members",
    [
        [_file("../escaped")],
        [_file("/escaped")],
        [_file("ok/../../escaped")],
        [_link("out", "../outside")],
        [_link("abs", "/etc/passwd")],
        [_link("hard", "../outside/escaped", tarfile.LNKTYPE)],
        [_link("up", ".."), _file("up/escaped")],
        [_device("null")],
    ],
    ids=[
        "dotdot",
        "absolute",
        "inner-dotdot",
        "symlink-out",
        "symlink-abs",
        "hardlink-out",
        "through-own-link",
        "device",
    ],
)
def test_tar_members_that_escape_are_refused(
    table: Any, tmp_path: Path, members: list[tarfile.TarInfo]
) -> None:
    dest = tmp_path / "dest" / "in"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "escaped").write_text("keep")
    with pytest.raises(ff.UnsafeArchiveError):
        _untar(_archive(*members), dest)
    assert (tmp_path / "outside" / "escaped").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.rglob("escaped")) == ["escaped"]
    assert len(table) == 0


def test_a_link_already_in_the_directory_is_not_followed_out(table: Any, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (tmp_path / "outside").mkdir()
    (dest / "evil").symlink_to(tmp_path / "outside")
    for name in ("evil/escaped", "evil/made/below/escaped"):
        with pytest.raises(ff.UnsafeArchiveError):
            _untar(_archive(_file(name)), dest)
    assert list((tmp_path / "outside").iterdir()) == []  # not even a directory made there


def test_an_abandoned_tar_download_stops_its_thread(table: Any, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(1 << 20))  # more than a pipe holds
    tid = ff.op_file_tar_open({"path": str(src)})["transfer_id"]
    ff.op_file_tar_read({"transfer_id": tid, "length": 1024})
    transfer = table._by_id[tid]
    assert ff.op_file_transfer_abort({"transfer_id": tid}) == {"aborted": True}
    transfer.thread.join(5)
    assert not transfer.thread.is_alive()


# ------------------------------------------------------------ through the agent


def test_the_agent_serves_the_ops_and_names_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    protocol = _load("forkd_agent_files_under_test", "forkd_agent_protocol.py")
    assert set(ff.OPS) <= set(protocol.OPS)
    files_mod = protocol.forkd_files
    open_line = protocol.handle_request(1, {"op": "file_upload_open", "path": str(tmp_path / "f")})
    tid = json.loads(open_line)["result"]["transfer_id"]

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_mod.os, "write", full)
    req = {"op": "file_upload_write", "transfer_id": tid, "offset": 0, "data": _b64(b"x")}
    answer = json.loads(protocol.handle_request(2, req))
    assert answer["ok"] is False and answer["kind"] == "NoSpaceError"
    assert os.listdir(tmp_path) == []


def test_a_chunk_that_arrives_early_waits_for_its_turn(table: Any, tmp_path: Path) -> None:
    """The host keeps two chunks in flight and each request has its own thread."""
    tid = _upload(tmp_path / "f")
    second = threading.Thread(
        target=ff.op_file_upload_write,
        args=({"transfer_id": tid, "offset": 3, "data": _b64(b"def")},),
    )
    second.start()
    time.sleep(0.1)
    assert second.is_alive()  # waiting, the lock released
    ff.op_file_upload_write({"transfer_id": tid, "offset": 0, "data": _b64(b"abc")})
    second.join(5)
    ff.op_file_upload_commit({"transfer_id": tid})
    assert (tmp_path / "f").read_bytes() == b"abcdef"


def test_an_early_chunk_gives_up_when_the_upload_is_aborted(table: Any, tmp_path: Path) -> None:
    tid = _upload(tmp_path / "f")
    errors: list[BaseException] = []

    def early() -> None:
        try:
            ff.op_file_upload_write({"transfer_id": tid, "offset": 3, "data": _b64(b"x")})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=early)
    thread.start()
    time.sleep(0.1)
    with table._lock:
        transfer = table._by_id[tid]
    with transfer.lock:
        transfer.abort()
        transfer.lock.notify_all()
    thread.join(5)
    assert not thread.is_alive() and isinstance(errors[0], ff.TransferGone)
    assert os.listdir(tmp_path) == []


def test_a_whole_file_in_the_open_itself(table: Any, tmp_path: Path) -> None:
    params = {"path": str(tmp_path / "f"), "data": _b64(b"all of it"), "commit": True}
    assert ff.op_file_upload_open(params) == {"path": str(tmp_path / "f"), "size": 9}
    assert (tmp_path / "f").read_bytes() == b"all of it" and len(table) == 0
    empty = {"path": str(tmp_path / "e"), "commit": True}
    assert ff.op_file_upload_open(empty)["size"] == 0 and (tmp_path / "e").read_bytes() == b""


def test_the_first_chunk_rides_with_the_open(table: Any, tmp_path: Path) -> None:
    opened = ff.op_file_upload_open({"path": str(tmp_path / "f"), "data": _b64(b"abc")})
    assert opened["size"] == 3
    tid = opened["transfer_id"]
    ff.op_file_upload_write({"transfer_id": tid, "offset": 3, "data": _b64(b"def")})
    ff.op_file_upload_commit({"transfer_id": tid})
    assert (tmp_path / "f").read_bytes() == b"abcdef"


def test_commit_in_the_open_is_for_files_only(table: Any, tmp_path: Path) -> None:
    for params in ({"format": "tar", "commit": True}, {"commit": "yes"}):
        with pytest.raises(ValueError, match="commit"):
            ff.op_file_upload_open({"path": str(tmp_path / "d"), **params})
    assert len(table) == 0


def test_a_full_disk_at_the_open_keeps_nothing(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ff.os, "write", full)
    for commit in (False, True):
        params = {"path": str(tmp_path / "f"), "data": _b64(b"x"), "commit": commit}
        with pytest.raises(ff.NoSpaceError):
            ff.op_file_upload_open(params)
    assert os.listdir(tmp_path) == [] and len(table) == 0


def test_a_full_disk_while_extracting_is_named(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive_unpack, "_write_all", full)
    with pytest.raises(ff.NoSpaceError):
        _untar(_archive(_file("a")), tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == [] and len(table) == 0


def test_reads_answer_raw_bytes_when_asked(table: Any, tmp_path: Path) -> None:
    """No base64 to make: the bytes follow the answer's line as they are."""
    (tmp_path / "f").write_bytes(b"0123456789")
    result = ff.op_file_read_range(
        {"path": str(tmp_path / "f"), "offset": 2, "length": 4, "raw": True}
    )
    assert isinstance(result, ff.WithRawBytes) and result.raw == [b"2345"]
    assert json.loads(b"".join(result)) == {"size": 10, "eof": False, "length": 4}
    protocol = _load("forkd_agent_raw_under_test", "forkd_agent_protocol.py")
    line = protocol.handle_request(
        7,
        {
            "op": "file_read_range",
            "path": str(tmp_path / "f"),
            "offset": 8,
            "length": 4,
            "raw": True,
        },
    )
    head, raw = line.split(b"\n", 1)
    assert head.startswith(b'{"id":7,"raw":2,') and raw == b"89"
    assert json.loads(head)["result"] == {"size": 10, "eof": True, "length": 2}
