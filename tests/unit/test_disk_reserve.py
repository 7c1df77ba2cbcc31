"""--disk-reserve holds for every write the daemon makes for a client (issue 35): a registry
declaring a 64 GiB layer is refused (507) before a byte of it is asked for, an archive
sent to /v1/images/load is stopped once the disk is down to the reserve, a volume
that would take the reserve is refused, and each keeps nothing. The disk that fills
is a real one: a small tmpfs mounted over the blob store (needs root)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd import paths
from forkd.controller.settings import Settings
from forkd.disk_reserve import DiskReserve, free_bytes
from forkd.errors import NoRoom
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.manifests import MAX_BLOB_BYTES
from forkd.vmm.volumes.disks import MIN_SIZE, VolumeStore
from tests import oci_images as oi


def mount_tmpfs(where: Path, mib: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")


@pytest.fixture
def small_blob_store(settings: Settings) -> Iterator[Path]:
    """The daemon's blob store on a 64 MiB disk of its own."""
    root = paths.blobs_dir()
    mount_tmpfs(root, 64)
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture
def daemon(client: TestClient, settings: Settings) -> TestClient:
    images = client.app.state.services.images  # type: ignore[attr-defined]
    images._importer = images._import_sync  # the daemon's own importer
    settings.disk_reserve_mib = 24
    return client


class _Declares64GiB(BaseHTTPRequestHandler):
    """A registry whose image's one layer is declared 64 GiB (and would stream zeros)."""

    asked: list[str] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        if self.path == "/v2/huge/manifests/1":
            body, kind = HUGE_MANIFEST, oi.OCI_MANIFEST
        elif self.path == f"/v2/huge/blobs/{HUGE_CONFIG.digest}":
            body, kind = HUGE_CONFIG.data, oi.OCI_CONFIG
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


HUGE_LAYER = {
    "mediaType": f"{oi.OCI_LAYER}+gzip",
    "digest": "sha256:" + "9" * 64,
    "size": MAX_BLOB_BYTES,
}
HUGE_CONFIG = oi.image([oi.layer({"x": b"x"})]).config
HUGE_MANIFEST = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": oi.OCI_MANIFEST,
        "config": HUGE_CONFIG.descriptor(),
        "layers": [HUGE_LAYER],
    }
).encode()


@pytest.fixture
def declares_64_gib() -> Iterator[str]:
    _Declares64GiB.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Declares64GiB)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_layer_declared_larger_than_the_disk_is_refused_before_a_byte(
    daemon: TestClient, settings: Settings, declares_64_gib: str, small_blob_store: Path
) -> None:
    settings.insecure_registries = (declares_64_gib,)
    r = daemon.post("/v1/images", json={"ref": f"{declares_64_gib}/huge:1"})
    assert r.status_code == 507, r.text
    assert "--disk-reserve" in r.json()["error"] and "nothing was kept" in r.json()["error"]
    assert f"/v2/huge/blobs/{HUGE_LAYER['digest']}" not in _Declares64GiB.asked
    store = BlobStore(paths.blobs_dir())
    assert not store.has(HUGE_CONFIG.digest) and list(store.digests()) == []


def test_an_archive_sent_to_load_stops_at_the_reserve_and_keeps_nothing(
    daemon: TestClient, small_blob_store: Path
) -> None:
    def endless() -> Iterator[bytes]:  # 80 MiB: more than the disk holds
        for _ in range(80):
            yield os.urandom(1 << 20)

    r = daemon.post("/v1/images/load?tag=big:1", content=endless())
    assert r.status_code == 507, r.text
    assert "--disk-reserve" in r.json()["error"]
    # Stopped before the disk was down to its 24 MiB reserve (a test client hands the
    # body over whole; over a socket it is read, and refused, as it comes).
    assert free_bytes(small_blob_store) > 24 << 20
    assert os.listdir(small_blob_store / "tmp") == []


def test_a_blob_writer_refuses_what_would_take_the_reserve(small_blob_store: Path) -> None:
    store = BlobStore(small_blob_store, reserve=DiskReserve(small_blob_store, 24 << 20))
    with pytest.raises(NoRoom), store.writer(None, 48 << 20) as w:  # declared: refused at once
        w.write(b"x")
    assert store.put(b"a small blob fits")  # above the reserve
    assert os.listdir(store.tmp_dir) == []


def test_a_volume_that_would_take_the_reserve_is_refused(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, 48)
    try:
        with pytest.raises(NoRoom, match="--disk-reserve"):
            VolumeStore(disk / "volumes", reserve_bytes=40 << 20).create("data", MIN_SIZE)
        assert list((disk / "volumes").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
