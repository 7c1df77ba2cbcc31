"""Streamed file routes, the SDK's ``sb.files`` and ``forkd cp`` against the real app over
the fake driver, under a real uvicorn on loopback (the fake guest: fake_files.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.client import Controller, ControllerError, Sandbox
from forkd.controller.services.file_transfer import CHUNK_BYTES
from forkd.errors import AgentError
from tests.unit.conftest import Invoke, Server
from tests.unit.fakes import FakeVM

MIB = 1 << 20


@pytest.fixture
def vm(server: Server, sid: str) -> FakeVM:
    return server.driver.vms[-1]


def _http(server: Server) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.token}"}
    )


def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_an_upload_goes_in_whole_chunks_and_lands_at_the_end(
    server: Server, sid: str, vm: FakeVM
) -> None:
    data = os.urandom(5 * MIB + 123)
    with _http(server) as http:  # chunked: no Content-Length, pieces of 100 000 bytes
        r = http.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=_pieces(data, 100_000)
        )
    assert r.status_code == 200, r.text
    assert r.json() == {"path": "/big", "size": len(data)}
    assert vm.contents.files["/big"] == data
    assert vm.transfers.chunk_sizes == [CHUNK_BYTES] * 5 + [123]
    assert vm.transfers.payloads == [True] * 5  # the agent said it reads raw chunks
    assert vm.transfers.opened == [(CHUNK_BYTES, False)]  # the first chunk went with the open
    assert vm.transfers.staged == {}


def test_a_small_file_is_one_agent_request(server: Server, sid: str, vm: FakeVM) -> None:
    with _http(server) as http:
        r = http.put(
            f"/v1/sandboxes/{sid}/files",
            params={"path": "/small"},
            content=_pieces(b"x" * 5000, 1000),
        )
    assert r.json() == {"path": "/small", "size": 5000}
    assert vm.transfers.opened == [(5000, True)] and vm.contents.files["/small"] == b"x" * 5000


def test_an_empty_upload_makes_an_empty_file(server: Server, sid: str, vm: FakeVM) -> None:
    with _http(server) as http:
        r = http.put(f"/v1/sandboxes/{sid}/files", params={"path": "/empty"}, content=b"")
    assert r.status_code == 200 and vm.contents.files["/empty"] == b""


def test_a_download_streams_with_its_length(server: Server, sid: str, vm: FakeVM) -> None:
    data = os.urandom(3 * MIB + 5)
    vm.contents.files["/d"] = data
    with (
        _http(server) as http,
        http.stream("GET", f"/v1/sandboxes/{sid}/files", params={"path": "/d"}) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["content-length"] == str(len(data))
        assert resp.read() == data


def test_a_tar_goes_both_ways_and_an_escaping_member_is_a_400(
    server: Server, sid: str, vm: FakeVM
) -> None:
    vm.contents.files.update({"/work/a.txt": b"alpha", "/work/sub/b.bin": os.urandom(3 * MIB)})
    with _http(server) as http:
        url = f"/v1/sandboxes/{sid}/files"
        r = http.get(url, params={"path": "/work", "format": "tar"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-tar")
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
        assert got == {
            "work/a.txt": b"alpha",
            "work/sub/b.bin": vm.contents.files["/work/sub/b.bin"],
        }
        r = http.put(url, params={"path": "/copy", "format": "tar"}, content=r.content)
        assert r.status_code == 200, r.text
        assert vm.contents.files["/copy/work/a.txt"] == b"alpha"
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w") as tar:
            info = tarfile.TarInfo("../etc/passwd")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        before = dict(vm.contents.files)
        r = http.put(url, params={"path": "/copy", "format": "tar"}, content=evil.getvalue())
        assert r.status_code == 400 and "refusing" in r.json()["error"], r.text
        assert vm.contents.files == before
        r = http.get(url, params={"path": "/nothing", "format": "tar"})
        assert r.status_code == 404, r.text


def test_a_full_guest_disk_is_507_and_keeps_nothing(server: Server, sid: str, vm: FakeVM) -> None:
    vm.contents.files["/keep"] = b"old"
    vm.transfers.disk_bytes = 2 * MIB
    with _http(server) as http:
        r = http.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/keep"}, content=os.urandom(6 * MIB)
        )
    assert r.status_code == 507, r.text
    assert "disk is full" in r.json()["error"]
    assert vm.contents.files["/keep"] == b"old" and vm.transfers.staged == {}


def test_a_refused_upload_is_aborted_and_its_body_read_to_the_end(
    server: Server, sid: str, vm: FakeVM
) -> None:
    """403 from the open: the client that sends its whole body first still gets it."""
    with _http(server) as http:
        r = http.put(
            f"/v1/sandboxes/{sid}/files",
            params={"path": "/proc/x"},
            content=_pieces(os.urandom(4 * MIB), 65536),
        )
    assert r.status_code == 403, r.text
    assert vm.transfers.staged == {}


def test_a_guest_failure_mid_upload_aborts_it(server: Server, sid: str, vm: FakeVM) -> None:
    vm.fail = "file_upload_write"
    with _http(server) as http:
        r = http.put(
            f"/v1/sandboxes/{sid}/files", params={"path": "/x"}, content=os.urandom(3 * MIB)
        )
    assert r.status_code == 502, r.text
    assert vm.transfers.staged == {} and vm.transfers.aborted
    assert "/x" not in vm.contents.files


def test_a_client_that_goes_away_aborts_the_upload(server: Server, sid: str, vm: FakeVM) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        (
            f"PUT /v1/sandboxes/{sid}/files?path=/gone HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {server.token}\r\nContent-Length: {64 * MIB}\r\n\r\n"
        ).encode()
        + b"x" * (3 * MIB)
    )
    deadline = time.monotonic() + 10
    while not vm.transfers.chunk_sizes and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()
    while not vm.transfers.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert vm.transfers.aborted and vm.transfers.staged == {}
    assert "/gone" not in vm.contents.files


def test_a_file_that_shrinks_while_read_ends_the_answer_short(
    server: Server, sid: str, vm: FakeVM
) -> None:
    vm.contents.files["/s"] = os.urandom(4 * MIB)
    real_read = vm.transfers.read

    def shrinking(path: str, offset: int, length: int) -> tuple[bytes, int | None, bool]:
        if offset > 0:  # after the answer began with a length of 4 MiB
            vm.contents.files["/s"] = vm.contents.files["/s"][: 2 * MIB]
        return real_read(path, offset, length)

    vm.transfers.read = shrinking  # type: ignore[method-assign]
    with _http(server) as http, pytest.raises(httpx.RemoteProtocolError):
        http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/s"})


# ------------------------------------------------------------ SDK


def test_sdk_write_takes_bytes_str_files_and_iterables(ctl: Controller, sid: str) -> None:
    sb = Sandbox.connect(sid, controller=ctl)
    big = os.urandom(2 * MIB + 7)
    assert sb.files.write("/a", big) == {"path": "/a", "size": len(big)}
    sb.files.write("/b", "héllo")
    sb.files.write("/c", io.BytesIO(big))
    sb.files.write("/d", _pieces(big, 300_000))
    assert sb.files.read("/a") == sb.files.read("/c") == sb.files.read("/d") == big
    assert sb.files.read("/b", format="text") == "héllo" == sb.files.read_text("/b")
    chunks = list(sb.files.read("/a", format="stream"))
    assert b"".join(chunks) == big and max(map(len, chunks)) <= MIB
    with pytest.raises(ValueError, match="format"):
        sb.files.read("/a", format="lines")  # type: ignore[call-overload]


def test_sdk_upload_and_download_local_files(ctl: Controller, sid: str, tmp_path: Path) -> None:
    sb = Sandbox.connect(sid, controller=ctl)
    tmp_path = tmp_path / "local"
    tmp_path.mkdir()
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(3 * MIB + 1))
    seen: list[tuple[int, int | None]] = []
    sb.files.upload(local, "/up", progress=lambda n, total: seen.append((n, total)))
    assert seen[-1] == (3 * MIB + 1, 3 * MIB + 1)
    assert sb.files.download("/up", tmp_path / "out.bin") == 3 * MIB + 1
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
    with pytest.raises(ControllerError) as exc:
        sb.files.download("/none", tmp_path / "none.bin")
    assert exc.value.status == 404
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.bin", "out.bin"]  # no partial


# ------------------------------------------------------------ forkd cp


def test_cp_copies_a_file_both_ways(forkd: Invoke, sid: str, vm: FakeVM, tmp_path: Path) -> None:
    local = tmp_path / "f.bin"
    local.write_bytes(os.urandom(MIB + 3))
    vm.contents.files["/dir/other"] = b"makes /dir a directory"
    res = forkd("cp", str(local), f"{sid}:/dir", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout) == {
        "src": str(local),
        "dst": f"{sid}:/dir/f.bin",
        "bytes": MIB + 3,
    }
    assert vm.contents.files["/dir/f.bin"] == local.read_bytes()
    res = forkd("cp", "-q", f"{sid}:/dir/f.bin", str(tmp_path / "back"))
    assert res.exit_code == 0 and res.stdout == "", res.stderr
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    assert hashlib.sha256((tmp_path / "back").read_bytes()).hexdigest() == digest


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["a", "b"], 2, "ID:/path"),
        (["x:/a", "y:/b"], 2, "ID:/path"),
        (["/no/such/local", "SID:/x"], 2, "does not exist"),
        (["SID:/no/such", "."], 1, "does not exist"),
    ],
)
def test_cp_refuses_clearly(
    forkd: Invoke, sid: str, args: list[str], code: int, message: str
) -> None:
    res = forkd("cp", *(a.replace("SID", sid) for a in args))
    assert res.exit_code == code and message in res.stderr, res.stderr


def test_cp_into_a_missing_local_directory_is_an_error_not_a_traceback(
    forkd: Invoke, sid: str, vm: FakeVM, tmp_path: Path
) -> None:
    vm.contents.files["/f"] = b"data"
    res = forkd("cp", f"{sid}:/f", str(tmp_path / "no" / "such" / "f"))
    assert res.exit_code == 1 and "No such file or directory" in res.stderr, res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit)


# ------------------------------------------------------------ an agent older than the chunks


def test_an_older_agent_still_moves_whole_files(server: Server, sid: str, vm: FakeVM) -> None:
    """A sandbox of a snapshot taken before streamed files: file_read/file_write, as then."""
    vm.transfers.legacy = True
    data = os.urandom(3 * MIB)
    with _http(server) as http:
        url = f"/v1/sandboxes/{sid}/files"
        r = http.put(url, params={"path": "/old"}, content=_pieces(data, 65536))
        assert r.status_code == 200 and r.json() == {"path": "/old", "size": len(data)}
        assert vm.contents.files["/old"] == data and vm.transfers.chunk_sizes == []
        r = http.get(url, params={"path": "/old"})
        assert r.status_code == 200 and r.content == data
        assert r.headers["content-length"] == str(len(data))
        r = http.put(url, params={"path": "/huge"}, content=os.urandom(33 * MIB))
        assert r.status_code == 400 and "at most" in r.json()["error"], r.text
        assert "/huge" not in vm.contents.files
        r = http.put(url, params={"path": "/d", "format": "tar"}, content=b"x" * 10)
        assert r.status_code == 409 and "newer guest agent" in r.json()["error"], r.text
        r = http.get(url, params={"path": "/no/such"})
        assert r.status_code == 404


def test_a_malformed_request_to_a_current_agent_is_not_taken_for_an_old_one(
    server: Server, sid: str, vm: FakeVM
) -> None:
    vm.transfers.disk_bytes = None

    def refuse(*args: object) -> None:
        raise AgentError("'offset' must be an integer >= 0", kind="ValueError")

    vm.transfers.read = refuse  # type: ignore[assignment]
    with _http(server) as http:
        r = http.get(f"/v1/sandboxes/{sid}/files", params={"path": "/x"})
    assert r.status_code == 400 and "offset" in r.json()["error"]


@pytest.mark.parametrize(
    ("listing", "says"),
    [
        (
            [{"name": "x", "type": "file", "size": 1, "mode": 420, "mtime": 0.0}] * 100_001,
            "more than the 100000 it lists at most",
        ),
        ([1, 2], "'entries'[0] is not an object"),
        (
            [{"name": "x", "type": "file", "size": "big", "mode": 420, "mtime": 0}],
            "'entries'[0]'s 'size' is not an integer",
        ),
        ({"name": "x"}, "'entries' is not a list"),
    ],
    ids=["too-many", "not-objects", "wrong-type", "not-a-list"],
)
def test_a_guests_file_listing_of_the_wrong_shape_is_a_502(
    server: Server, sid: str, vm: FakeVM, listing: object, says: str
) -> None:
    """More entries than the agent lists, or entries that are not entries: the answer is
    refused where it is read (the daemon's check of every agent answer), before the daemon
    builds a model of each (it used to, or answered with a 500)."""

    vm._listing = lambda path: listing  # type: ignore[method-assign]
    with _http(server) as http:
        r = http.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/"})
    assert r.status_code == 502, r.text
    assert says in r.json()["error"]
