"""Issue 36, item 15: the original forkd's ``pack`` and ``unpack``. A snapshot goes to a
file as an OCI archive (``GET /v1/snapshots/{tag}/export``: what a push sends a registry,
a diff's bases too) and comes back from one (``POST /v1/snapshots/import``), as a pull
reads a registry: every blob checked, nothing kept on any failure. Over the unit
tests' daemon (fake VMs, whose snapshot files are real files)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import httpx2
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from forkd.controller.settings import Settings
from tests.unit.conftest import RecordingTransport, Server, make_app


@pytest.fixture
def packed(client: TestClient) -> bytes:
    assert client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    r = client.get("/v1/snapshots/py/export")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    return r.content


def _import(client: TestClient, body: bytes, tag: str | None = None) -> httpx2.Response:
    params = {"tag": tag} if tag else {}
    return client.post(
        "/v1/snapshots/import",
        params=params,
        content=body,
        headers={"Content-Type": "application/x-tar"},
    )


def _leftovers(settings: Settings) -> list[str]:
    return sorted(p.name for p in settings.snapshot_root.iterdir() if p.name.startswith("."))


def test_a_snapshot_packed_and_unpacked_forks(
    client: TestClient, settings: Settings, packed: bytes
) -> None:
    with tarfile.open(fileobj=io.BytesIO(packed)) as tar:
        names = tar.getnames()
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
    assert "oci-layout" in names and any(n.startswith("blobs/sha256/") for n in names)
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == [
        "py"
    ]
    r = _import(client, packed)  # its own tag: taken
    assert r.status_code == 409 and "already exists" in r.json()["error"]
    r = _import(client, packed, "copy")
    assert r.status_code == 201, r.text
    assert r.json()["tag"] == "copy" and r.json()["bootable"]
    assert client.post("/v1/sandboxes", json={"snapshot_tag": "copy"}).status_code == 201
    assert client.get("/v1/snapshots/py").status_code == 200  # the source is untouched
    assert _leftovers(settings) == []  # the pack and the received archive are gone


def test_a_diff_travels_with_its_base(client: TestClient, packed: bytes) -> None:
    sid = client.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
    r = client.post(f"/v1/sandboxes/{sid}/branch", json={"tag": "d1", "mode": "diff"})
    assert r.status_code == 201, r.text
    diff = client.get("/v1/snapshots/d1/export")
    assert diff.status_code == 200
    r = _import(client, diff.content, "d1-copy")
    assert r.status_code == 201, r.text
    assert client.post("/v1/sandboxes", json={"snapshot_tag": "d1-copy"}).status_code == 201


def _tampered(packed: bytes) -> bytes:
    """The archive with one byte of its biggest blob changed (its name kept)."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(packed)) as src,
        tarfile.open(fileobj=out, mode="w") as dst,
    ):
        blobs = [m for m in src.getmembers() if m.name.startswith("blobs/")]
        biggest = max(blobs, key=lambda m: m.size)
        for m in src.getmembers():
            data = src.extractfile(m).read()  # type: ignore[union-attr]
            if m.name == biggest.name:
                data = bytes([data[0] ^ 1]) + data[1:]
            dst.addfile(m, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_tampered, "does not hold what its digest says"),
        (lambda _p: b"not a tar at all" * 64, "not a tar archive"),
        (lambda _p: b"", "no body"),
    ],
)
def test_an_archive_that_is_not_what_it_says_is_refused_and_nothing_kept(
    client: TestClient, settings: Settings, packed: bytes, make: Callable[[bytes], bytes], said: str
) -> None:
    r = _import(client, make(packed), "bad")
    assert r.status_code == 400 and said in r.json()["error"], r.text
    assert client.get("/v1/snapshots/bad").status_code == 404
    assert _leftovers(settings) == []


def test_pack_and_unpack_on_the_command_line(
    server: Server, sent: RecordingTransport, tmp_path: Path
) -> None:
    app = make_app(sent)
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    run = CliRunner().invoke
    assert (
        run(app, ["snapshot", "create", "--tag", "py", "--memory", "128"], env=env).exit_code == 0
    )
    out = tmp_path / "py.tar"
    res = run(app, ["pack", "--tag", "py", "-o", str(out), "--description", "x"], env=env)
    assert res.exit_code == 0, res.output
    assert out.is_file() and "an OCI archive" in res.stderr and "not stored" in res.stderr
    res = run(app, ["unpack", str(out)], env=env)
    assert res.exit_code == 1 and "already exists" in res.stderr
    res = run(app, ["unpack", str(out), "--tag", "py2"], env=env)
    assert res.exit_code == 0 and "unpacked tag 'py2'" in res.stderr, res.output
    res = run(app, ["unpack", str(out), "--force"], env=env)  # replaces py
    assert res.exit_code == 0 and "deleted snapshot py (--force)" in res.stderr, res.output
    res = run(
        app, ["pack", "--tag", "py", "--format", "json", "-o", str(tmp_path / "b.tar")], env=env
    )
    assert res.exit_code == 0 and json.loads(res.stdout)["bytes"] > 0


def test_unpack_force_keeps_the_old_snapshot_when_the_archive_fails(
    server: Server, sent: RecordingTransport, tmp_path: Path
) -> None:
    app = make_app(sent)
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    run = CliRunner().invoke
    assert (
        run(app, ["snapshot", "create", "--tag", "py", "--memory", "128"], env=env).exit_code == 0
    )
    good = tmp_path / "py.tar"
    assert run(app, ["pack", "--tag", "py", "-o", str(good)], env=env).exit_code == 0
    bad = tmp_path / "bad.tar"
    bad.write_bytes(_tampered(good.read_bytes()))
    res = run(app, ["unpack", str(bad), "--force"], env=env)  # the packed tag, py: taken
    assert res.exit_code == 1 and "does not hold what its digest says" in res.stderr
    snaps = [r for r in sent.requests if r.method == "DELETE" and r.url.path == "/v1/snapshots/py"]
    assert snaps == []  # py was never deleted
    with_py = run(app, ["snapshot", "ls", "-o", "json"], env=env)
    assert [s["tag"] for s in json.loads(with_py.stdout)] == ["py"]  # no staged leftover
    compressed = tmp_path / "py.tar.gz"
    with tarfile.open(compressed, "w:gz") as tar:
        tar.add(good, arcname="inner.tar")
    res = run(app, ["unpack", str(compressed), "--force"], env=env)
    assert res.exit_code == 1 and "give --tag" in res.stderr


def test_the_async_client_packs_unpacks_and_imports_a_volume(
    server: Server, tmp_path: Path
) -> None:
    import asyncio
    import subprocess

    from forkd.client import AsyncController

    image = tmp_path / "data.ext4"
    with image.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)

    async def use() -> None:
        async with AsyncController(server.url, token=server.token) as ctl:
            vol = await ctl.import_volume("adata", image)
            assert vol["name"] == "adata" and vol["size_bytes"] == 16 << 20
            await ctl.create_snapshot("apy", memory_mib=128)
            size = await ctl.export_snapshot("apy", tmp_path / "apy.tar")
            assert size == (tmp_path / "apy.tar").stat().st_size
            info = await ctl.import_snapshot(tmp_path / "apy.tar", "apy2")
            assert info["tag"] == "apy2"

    asyncio.run(use())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
