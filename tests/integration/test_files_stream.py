"""Large files streamed in and out of real VMs: 100 MiB through the HTTP route, the SDK
and ``forkd cp`` (files and directories), a full guest disk answered 507 with nothing
left behind, tar members that would escape refused, and small files as before."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.client import Controller, ControllerError, Sandbox

from .conftest import Daemon

pytestmark = pytest.mark.integration

BIG = 100 << 20
PIECE = 1 << 20


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 MiB that do not compress: a repeated random MiB would, so each MiB differs."""
    path = tmp_path_factory.mktemp("big") / "big.bin"
    seed = os.urandom(PIECE)
    with path.open("wb") as f:
        for i in range(BIG // PIECE):
            f.write(hashlib.sha256(i.to_bytes(4, "big")).digest() + seed[32:])
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(PIECE):
            h.update(chunk)
    return h.hexdigest()


def _guest_sha256(sb: Sandbox, path: str) -> str:
    r = sb.commands.run(["sha256sum", path], timeout=120)
    assert r.exit_code == 0, r.stderr
    return r.stdout.split()[0]


def _leftovers(sb: Sandbox, directory: str) -> list[str]:
    r = sb.commands.run(["ls", "-a", directory])
    assert r.exit_code == 0, r.stderr
    return [n for n in r.stdout.split() if n.startswith(".forkd-upload-")]


def _http(daemon: Daemon) -> httpx.Client:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    return httpx.Client(base_url=daemon.url, headers=headers, timeout=300)


def _report(what: str, nbytes: int, seconds: float) -> None:
    rate = nbytes / seconds / (1 << 20)
    print(f"\n{what}: {rate:.1f} MiB/s ({nbytes >> 20} MiB in {seconds:.2f} s)")


def test_100_mib_through_the_http_route(daemon: Daemon, sb: Sandbox, big_file: Path) -> None:
    digest = _sha256(big_file)
    url = f"/v1/sandboxes/{sb.id}/files"

    def body() -> Iterator[bytes]:
        with big_file.open("rb") as f:
            while chunk := f.read(256 << 10):
                yield chunk

    with _http(daemon) as http:
        t0 = time.monotonic()
        r = http.put(url, params={"path": "/root/big.bin"}, content=body())
        up = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json() == {"path": "/root/big.bin", "size": BIG}
        _report("upload (HTTP, chunked)", BIG, up)
        assert _guest_sha256(sb, "/root/big.bin") == digest
        assert _leftovers(sb, "/root") == []

        h = hashlib.sha256()
        got = 0
        t0 = time.monotonic()
        with http.stream("GET", url, params={"path": "/root/big.bin"}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-length"] == str(BIG)
            for chunk in resp.iter_bytes():
                h.update(chunk)
                got += len(chunk)
        down = time.monotonic() - t0
        _report("download (HTTP)", got, down)
        assert got == BIG and h.hexdigest() == digest


def test_100_mib_through_the_sdk(sb: Sandbox, big_file: Path, tmp_path: Path) -> None:
    digest = _sha256(big_file)
    with big_file.open("rb") as f:
        assert sb.files.write("/root/sdk.bin", f) == {"path": "/root/sdk.bin", "size": BIG}
    assert _guest_sha256(sb, "/root/sdk.bin") == digest

    h = hashlib.sha256()
    for chunk in sb.files.read("/root/sdk.bin", format="stream"):
        assert len(chunk) <= 1 << 20
        h.update(chunk)
    assert h.hexdigest() == digest

    seen: list[tuple[int, int | None]] = []
    moved = sb.files.download(
        "/root/sdk.bin", tmp_path / "back.bin", progress=lambda n, total: seen.append((n, total))
    )
    assert moved == BIG and _sha256(tmp_path / "back.bin") == digest
    assert seen[-1] == (BIG, BIG)
    sb.files.remove("/root/sdk.bin")  # guest files live in its RAM (256 MiB here)
    assert sb.files.upload(big_file, "/root/up.bin")["size"] == BIG
    assert _guest_sha256(sb, "/root/up.bin") == digest


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forkd.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=daemon.env(),
    )


def test_forkd_cp_a_file_both_ways(
    daemon: Daemon, sb: Sandbox, big_file: Path, tmp_path: Path
) -> None:
    digest = _sha256(big_file)
    r = _cli(daemon, "cp", str(big_file), f"{sb.id}:/root/", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "src": str(big_file),
        "dst": f"{sb.id}:/root/big.bin",
        "bytes": BIG,
    }
    assert _guest_sha256(sb, "/root/big.bin") == digest

    r = _cli(daemon, "cp", "-q", f"{sb.id}:/root/big.bin", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and _sha256(tmp_path / "big.bin") == digest

    r = _cli(daemon, "cp", f"{sb.id}:/no/such/file", str(tmp_path))
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = _cli(daemon, "cp", str(big_file), str(tmp_path / "x"))
    assert r.returncode == 2 and "ID:/path" in r.stderr


def _make_tree(root: Path, big_file: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "sub" / "run.sh").chmod(0o755)
    (root / "sub" / "deeper" / "big.bin").symlink_to(big_file)  # a link stays a link
    (root / "sub" / "deeper" / "data.bin").write_bytes(os.urandom(3 << 20))
    (root / "link").symlink_to("sub/run.sh")


def _tree(root: Path) -> dict[str, str]:
    """Every entry under root: a file's sha256, a link's target, "dir"."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = _sha256(path) + oct(path.stat().st_mode & 0o777)
    return found


def test_forkd_cp_a_directory_both_ways(
    daemon: Daemon, sb: Sandbox, big_file: Path, tmp_path: Path
) -> None:
    tree = tmp_path / "proj"
    tree.mkdir()
    _make_tree(tree, big_file)
    (tree / "sub" / "deeper" / "big.bin").unlink()
    (tree / "huge.bin").write_bytes(big_file.read_bytes())

    r = _cli(daemon, "cp", "-q", str(tree), f"{sb.id}:/root/proj")
    assert r.returncode == 0, r.stderr
    assert _guest_sha256(sb, "/root/proj/huge.bin") == _sha256(big_file)
    ran = sb.commands.run(
        [
            "sh",
            "-c",
            "readlink /root/proj/link; stat -c %a /root/proj/sub/run.sh;"
            " ls /root/proj/empty | wc -l",
        ]
    )
    assert ran.stdout.split() == ["sub/run.sh", "755", "0"]

    # Onto an existing directory it goes inside it, as cp -r does.
    r = _cli(daemon, "cp", "-q", f"{sb.id}:/root/proj", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "back") == _tree(tree)
    r = _cli(daemon, "cp", "-q", f"{sb.id}:/root/proj", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "back" / "proj") == _tree(tree)


def test_a_full_guest_disk_is_507_and_leaves_nothing(daemon: Daemon, sb: Sandbox) -> None:
    r = sb.commands.run(
        [
            "sh",
            "-c",
            "mkdir -p /mnt/small && mount -t tmpfs -o size=8m tmpfs "
            "/mnt/small && echo old > /mnt/small/keep",
        ]
    )
    assert r.exit_code == 0, r.stderr
    with _http(daemon) as http:
        url = f"/v1/sandboxes/{sb.id}/files"
        put = http.put(url, params={"path": "/mnt/small/keep"}, content=os.urandom(24 << 20))
        assert put.status_code == 507, put.text
        assert "full" in put.json()["error"]
        assert http.get(url, params={"path": "/mnt/small/keep"}).content == b"old\n"
    assert _leftovers(sb, "/mnt/small") == []
    with pytest.raises(ControllerError) as exc:
        sb.files.write("/mnt/small/new", iter([os.urandom(1 << 20)] * 12))
    assert exc.value.status == 507
    r = sb.commands.run(["ls", "-a", "/mnt/small"])
    assert r.stdout.split() == [".", "..", "keep"]
    r = sb.commands.run(["df", "-k", "/mnt/small"])
    assert r.stdout.split()[-4] == "4", r.stdout  # 4 KiB used: only "keep"


def test_tar_members_that_escape_are_refused(daemon: Daemon, sb: Sandbox) -> None:
    def archive(*members: tarfile.TarInfo) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m in members:
                tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
        return buf.getvalue()

    def file(name: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.size = 1
        return info

    def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        return info

    with _http(daemon) as http:
        url = f"/v1/sandboxes/{sb.id}/files"
        for bad in (
            file("../escaped"),
            file("/root/escaped"),
            file("ok/../../escaped"),
            link("out", "../../root"),
            link("abs", "/etc/passwd"),
            link("hard", "../etc/passwd", tarfile.LNKTYPE),
        ):
            r = http.put(url, params={"path": "/tmp/x/in", "format": "tar"}, content=archive(bad))
            assert r.status_code == 400, (bad.name, r.text)
        # A link inside that a later member writes through is refused too.
        r = http.put(
            url,
            params={"path": "/tmp/x/in", "format": "tar"},
            content=archive(link("up", ".."), file("up/escaped")),
        )
        assert r.status_code == 400, r.text
    ran = sb.commands.run(["sh", "-c", "find / -xdev -name escaped | wc -l"], timeout=60)
    assert ran.stdout.strip() == "0"


def test_small_files_as_before(sb: Sandbox, ctl: Controller) -> None:
    sb.files.write("/tmp/s.txt", "héllo")
    assert sb.files.read("/tmp/s.txt") == "héllo".encode()
    assert sb.files.read("/tmp/s.txt", format="text") == "héllo"
    assert ctl.read_file(sb.id, "/tmp/s.txt") == "héllo".encode()
    sb.files.write("/tmp/empty", b"")
    assert sb.files.read("/tmp/empty") == b""
    assert sb.files.read("/proc/sys/kernel/hostname").strip() != b""
    sb.commands.run(["sh", "-c", "echo old > /tmp/x.sh && chmod 750 /tmp/x.sh"])
    sb.files.write("/tmp/x.sh", "new\n")  # replacing a file keeps its mode
    assert sb.commands.run(["stat", "-c", "%a", "/tmp/x.sh"]).stdout.strip() == "750"
    sb.files.write("/tmp/new/dir/f", "made")  # parents are made
    assert sb.files.read("/tmp/new/dir/f") == b"made"
    for path, status in (("/no/such", 404), ("/tmp", 400), ("relative", 400)):
        with pytest.raises(ControllerError) as exc:
            sb.files.read(path)
        assert exc.value.status == status, path


def test_a_client_that_goes_away_leaves_no_staged_file(daemon: Daemon, sb: Sandbox) -> None:
    import socket

    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        (
            f"PUT /v1/sandboxes/{sb.id}/files?path=/root/gone.bin HTTP/1.1\r\n"
            f"Host: x\r\nAuthorization: Bearer {daemon.token}\r\n"
            f"Content-Length: {BIG}\r\n\r\n"
        ).encode()
        + b"x" * (8 << 20)
    )
    deadline = time.monotonic() + 30
    while not _leftovers(sb, "/root") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(sb, "/root"), "the upload never started"
    sock.close()
    deadline = time.monotonic() + 30
    while _leftovers(sb, "/root") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(sb, "/root") == []
    assert sb.commands.run(["test", "-e", "/root/gone.bin"]).exit_code == 1
