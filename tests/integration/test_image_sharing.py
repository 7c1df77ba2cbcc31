"""Issue 36, item 2, with two real daemons on one host sharing one image cache (the
suite's): one imports an image from a registry that holds its layer back; the other
loads an image of its own and removes it, which frees every blob no built image needs.
The blobs the first daemon's import already holds stay (a hold lived in one process's
memory before: another daemon swept them), and the import then finishes. That a
snapshot of one daemon keeps its image from another's removal is tested in
tests/unit/test_image_sharing.py (a snapshot here would need a VM booted for it)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from forkd import paths
from forkd.client import Controller
from tests import oci_images as oi
from tests.integration.conftest import Daemon

pytestmark = pytest.mark.integration

RUN = os.urandom(8).hex().encode()  # an image no earlier run built (the cache is shared)
HELD_BACK = oi.image(
    [oi.layer({"first": b"stored at once " + RUN}), oi.layer({"held": b"back " + RUN})],
    {"Cmd": ["held"]},
)
THEIRS = oi.image([oi.layer({"theirs": b"other daemon's\n"})], {"Cmd": ["theirs"]})


class _Gated(BaseHTTPRequestHandler):
    """A registry serving HELD_BACK whose second layer is sent only once ``gate`` is set
    (its first is stored by then)."""

    gate = threading.Event()
    layer_asked = threading.Event()

    def do_GET(self) -> None:
        routes = {"/v2/held/manifests/1": (HELD_BACK.manifest.media_type, HELD_BACK.manifest.data)}
        routes |= {
            f"/v2/held/blobs/{b.digest}": ("application/octet-stream", b.data)
            for b in HELD_BACK.blobs()
        }
        kind, body = routes.get(self.path, ("text/plain", b""))
        if self.path == f"/v2/held/blobs/{HELD_BACK.layers[1].digest}":
            self.layer_asked.set()
            self.gate.wait(60)
        self.send_response(200 if self.path in routes else 404)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def registry() -> Iterator[str]:
    _Gated.gate, _Gated.layer_asked = threading.Event(), threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    _Gated.gate.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def two_daemons(registry: str) -> Iterator[tuple[Daemon, Daemon]]:
    made: list[Daemon] = []
    try:
        for _ in range(2):
            d = Daemon(Path(tempfile.mkdtemp(prefix="forkd-ds-", dir="/tmp")))
            made.append(d)
            d.start("--kill-on-exit", "--insecure-registry", registry)
        yield made[0], made[1]
    finally:
        for d in made:
            d.stop()
            d.kill_leftovers()
            shutil.rmtree(d.root, ignore_errors=True)


def test_a_removal_in_one_daemon_keeps_the_blobs_of_an_import_in_another(
    two_daemons: tuple[Daemon, Daemon], registry: str, tmp_path: Path
) -> None:
    importing, removing = two_daemons
    held_blob = paths.blobs_dir() / "sha256" / HELD_BACK.layers[0].digest.removeprefix("sha256:")
    answer: dict[str, Any] = {}

    def run_import() -> None:
        with Controller(importing.url, token=importing.token, timeout=120) as ctl:
            answer.update(ctl.import_image(f"{registry}/held:1"))

    thread = threading.Thread(target=run_import)
    thread.start()
    try:
        assert _Gated.layer_asked.wait(60), "the import never asked for its second layer"
        assert held_blob.is_file()  # fetched, and held by the import in flight
        archive = oi.write_oci_archive(tmp_path / "theirs.tar", {"1": THEIRS})
        with Controller(removing.url, token=removing.token, timeout=120) as ctl:
            loaded = ctl.load_image(archive, "theirs:1")
            ctl.delete_image("theirs:1")  # sweeps every blob no built image needs
            assert loaded["name"] not in {i["name"] for i in ctl.list_images()}
        assert held_blob.is_file(), "another daemon's removal swept a blob an import held"
    finally:
        _Gated.gate.set()
        thread.join(120)
    assert answer.get("name"), answer
    with Controller(removing.url, token=removing.token) as ctl:  # one cache: both see it
        assert answer["name"] in {i["name"] for i in ctl.list_images()}
        ctl.delete_image(answer["name"])
