"""Images from files on the daemon's host and from a Docker Engine, into the blob store, no
VM: OCI layout directories and archives, ``docker save`` archives of both layouts
(checked against the config's diff_ids), a fake Docker Engine on a unix socket
(the real export client), and every bad file, each leaving no temporary file."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socketserver
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from forkd.errors import Invalid, NotFound, Unavailable
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.fetch import fetch_image
from forkd.image_import.model import FetchedImage
from forkd.oci.policy import RegistryPolicy
from tests import oci_images as oi

BASE = oi.layer({"etc/": oi.Dir(), "etc/hostname": b"base\n"})
APP = oi.image(
    [BASE, oi.layer({"app/run": oi.File(b"#!/bin/sh\n", 0o755)}, "zstd")],
    {"Cmd": ["/app/run"], "WorkingDir": "/app"},
)
OTHER = oi.image([BASE, oi.layer({"other": b"o"}, "none")], {"Cmd": ["other"]})


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def fetch(text: str, store: BlobStore, **kw: Any) -> FetchedImage:
    return fetch_image(text, store, policy=RegistryPolicy(), **kw)


def clean(store: BlobStore) -> bool:
    return not store.tmp_dir.exists() or not any(store.tmp_dir.iterdir())


def layers_of(got: FetchedImage) -> list[bytes]:
    return [b.path.read_bytes() for b in got.layers]


# ---------------------------------------------------------------------- OCI layouts


def test_an_oci_layout_directory_gives_the_image_of_its_tag(
    tmp_path: Path, store: BlobStore
) -> None:
    layout = oi.write_oci_layout(tmp_path / "layout", {"app": APP, "other": OTHER})
    got = fetch(f"oci:{layout}:app", store)
    assert got.reference == f"oci:{layout}:app"
    assert got.manifest_digest == APP.manifest.digest and got.config.cmd == ("/app/run",)
    assert layers_of(got) == [lay.data for lay in APP.layers]
    assert got.bytes_fetched == APP.manifest.size + APP.config.size + sum(
        lay.size for lay in APP.layers
    )
    other = fetch(f"oci:{layout}:other", store)
    assert other.bytes_reused == BASE.size  # the shared base is not copied again
    assert clean(store)


def test_an_oci_layout_with_several_images_needs_a_tag_and_knows_its_tags(
    tmp_path: Path, store: BlobStore
) -> None:
    layout = oi.write_oci_layout(tmp_path / "layout", {"app": APP, "other": OTHER})
    with pytest.raises(Invalid, match="app, other"):
        fetch(f"oci:{layout}", store)
    with pytest.raises(NotFound, match=r"'nope'.*app, other"):
        fetch(f"oci:{layout}:nope", store)
    single = oi.write_oci_layout(tmp_path / "single", {"only": APP})
    assert fetch(f"oci:{single}", store).manifest_digest == APP.manifest.digest


def test_an_oci_layout_of_an_index_gives_linux_amd64(tmp_path: Path, store: BlobStore) -> None:
    arm = oi.image([oi.layer({"arm": b"arm"})], platform="linux/arm64")
    layout = oi.write_oci_layout(
        tmp_path / "l", {"v1": oi.index({"linux/arm64": arm, "linux/amd64": APP})}
    )
    assert fetch(f"oci:{layout}:v1", store).manifest_digest == APP.manifest.digest


def test_an_oci_archive_is_read_without_unpacking(tmp_path: Path, store: BlobStore) -> None:
    archive = oi.write_oci_archive(tmp_path / "image.tar", {"app": APP, "v2": OTHER})
    got = fetch(f"oci-archive:{archive}:app", store)
    assert got.reference == f"oci-archive:{archive}:app"
    assert layers_of(got) == [lay.data for lay in APP.layers]
    assert sorted(os.listdir(tmp_path)) == ["blobs", "image.tar"]  # nothing unpacked
    again = fetch(f"oci-archive:{archive}:app", store)
    assert again.bytes_fetched == APP.manifest.size  # the same image: nothing copied
    assert clean(store)


def test_a_layout_blob_reached_through_a_symlink_is_refused(
    tmp_path: Path, store: BlobStore
) -> None:
    outside = tmp_path / "secret"
    outside.write_bytes(APP.layers[1].data)  # even the right bytes: never read through a link
    layout = oi.write_oci_layout(tmp_path / "l", {"app": APP})
    blob = layout / "blobs" / "sha256" / APP.layers[1].digest[7:]
    blob.unlink()
    blob.symlink_to(outside)
    with pytest.raises(Invalid, match="symlink"):
        fetch(f"oci:{layout}:app", store)
    assert not store.has(APP.layers[1].digest) and clean(store)
    # A symlinked directory on the way.
    layout2 = oi.write_oci_layout(tmp_path / "l2", {"app": APP})
    shutil.move(layout2 / "blobs", tmp_path / "elsewhere")
    (layout2 / "blobs").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Invalid, match="symlink"):
        fetch(f"oci:{layout2}:app", store)


def test_a_layout_blob_that_is_not_its_descriptor_is_refused_and_not_kept(
    tmp_path: Path, store: BlobStore
) -> None:
    layout = oi.write_oci_layout(tmp_path / "l", {"app": APP})
    blob = layout / "blobs" / "sha256" / APP.layers[1].digest[7:]
    data = bytearray(blob.read_bytes())
    data[5] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(Invalid, match="digest"):
        fetch(f"oci:{layout}:app", store)
    assert not store.has(APP.layers[1].digest)
    blob.write_bytes(APP.layers[1].data + b"x")
    with pytest.raises(Invalid, match="bytes"):
        fetch(f"oci:{layout}:app", store)
    assert not store.has(APP.layers[1].digest) and clean(store)


def test_a_layout_with_a_hostile_index_is_refused(tmp_path: Path, store: BlobStore) -> None:
    layout = oi.write_oci_layout(tmp_path / "l", {"app": APP})
    (layout / "index.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(Invalid, match="nested"):
        fetch(f"oci:{layout}", store)
    (layout / "index.json").write_bytes(b" " * (5 << 20))
    with pytest.raises(Invalid, match="more than"):
        fetch(f"oci:{layout}", store)
    (layout / "oci-layout").unlink()
    with pytest.raises(Invalid, match="not an OCI image layout"):
        fetch(f"oci:{layout}", store)


def test_missing_or_wrong_paths_are_clear_errors(tmp_path: Path, store: BlobStore) -> None:
    with pytest.raises(NotFound):
        fetch(f"oci-archive:{tmp_path}/nope.tar", store)
    with pytest.raises(NotFound):
        fetch(f"docker-archive:{tmp_path}/nope.tar", store)
    with pytest.raises(NotFound):
        fetch(f"oci:{tmp_path}/nope", store)
    with pytest.raises(Invalid, match="not a regular file"):
        fetch(f"docker-archive:{tmp_path}", store)
    (tmp_path / "file").write_bytes(b"x" * 2000)
    with pytest.raises(Invalid, match="not a directory"):
        fetch(f"oci:{tmp_path}/file", store)
    with pytest.raises(Invalid, match="not a tar"):
        fetch(f"oci-archive:{tmp_path}/file", store)
    gz = tmp_path / "saved.tar.gz"
    gz.write_bytes(
        gzip.compress(oi.write_docker_archive(tmp_path / "s.tar", {"a:1": APP}).read_bytes())
    )
    with pytest.raises(Invalid, match="decompress"):
        fetch(f"docker-archive:{gz}", store)
    assert clean(store)


def test_an_archive_holding_a_name_twice_is_refused(tmp_path: Path, store: BlobStore) -> None:
    archive = oi.write_oci_archive(tmp_path / "image.tar", {"app": APP})
    doubled = tmp_path / "doubled.tar"
    # Two tars end to end, the first one's end blocks dropped: every name twice.
    body = archive.read_bytes().rstrip(b"\0")
    body += bytes(-len(body) % 512)
    doubled.write_bytes(body + archive.read_bytes())
    with pytest.raises(Invalid, match="twice"):
        fetch(f"oci-archive:{doubled}:app", store)


# ---------------------------------------------------------------------- docker save


@pytest.mark.parametrize("oci_blobs", [False, True], ids=["docker<25", "docker>=25"])
def test_a_docker_save_archive_gives_its_image_checked_against_diff_ids(
    tmp_path: Path, store: BlobStore, oci_blobs: bool
) -> None:
    archive = oi.write_docker_archive(tmp_path / "saved.tar", {"app:1": APP}, oci_blobs=oci_blobs)
    got = fetch(f"docker-archive:{archive}", store)
    assert got.config_digest == APP.config.digest and got.config.cmd == ("/app/run",)
    # Stored as the uncompressed tars docker saves: their digests are the diff_ids.
    assert [b.digest for b in got.layers] == [lay.diff_id for lay in APP.layers]
    assert layers_of(got) == [lay.tar for lay in APP.layers]
    assert {b.media_type for b in got.layers} == {oi.OCI_LAYER}
    assert store.has(got.manifest_digest) and store.has(got.config_digest)
    again = fetch(f"docker-archive:{archive}", store)
    assert again.manifest_digest == got.manifest_digest and again.bytes_fetched == 0
    assert again.bytes_reused == sum(len(lay.tar) for lay in APP.layers)
    assert clean(store)


def test_a_docker_archive_of_several_images_is_chosen_from_by_tag(
    tmp_path: Path, store: BlobStore
) -> None:
    archive = oi.write_docker_archive(tmp_path / "saved.tar", {"app:1": APP, "other:latest": OTHER})
    with pytest.raises(Invalid, match="app:1, other:latest"):
        fetch(f"docker-archive:{archive}", store)
    assert fetch(f"docker-archive:{archive}:app:1", store).config.cmd == ("/app/run",)
    assert fetch(f"docker-archive:{archive}:other", store).config.cmd == ("other",)
    with pytest.raises(NotFound, match="app:2"):
        fetch(f"docker-archive:{archive}:app:2", store)


def test_a_docker_archive_layer_that_is_not_its_diff_id_is_refused_and_not_kept(
    tmp_path: Path, store: BlobStore
) -> None:
    liar = oi.layer({"etc/hostname": b"evil\n"})
    img = oi.image([liar], diff_ids=[BASE.diff_id])  # the config names another layer
    archive = tmp_path / "saved.tar"
    name = f"{BASE.diff_id[7:]}/layer.tar"
    archive.write_bytes(
        oi.tar_of(
            {
                f"{img.config.digest[7:]}.json": img.config.data,
                name: liar.tar,
                "manifest.json": json.dumps(
                    [
                        {
                            "Config": f"{img.config.digest[7:]}.json",
                            "RepoTags": ["x:1"],
                            "Layers": [name],
                        }
                    ]
                ).encode(),
            }
        )
    )
    with pytest.raises(Invalid, match="diff_id"):
        fetch(f"docker-archive:{archive}", store)
    assert not store.has(liar.diff_id) and not store.has(BASE.diff_id) and clean(store)


def test_a_docker_archive_config_not_matching_its_name_is_refused(
    tmp_path: Path, store: BlobStore
) -> None:
    archive = tmp_path / "saved.tar"
    name = "a" * 64 + ".json"
    lay = f"{BASE.diff_id[7:]}/layer.tar"
    archive.write_bytes(
        oi.tar_of(
            {
                name: APP.config.data,
                lay: BASE.tar,
                "manifest.json": json.dumps([{"Config": name, "Layers": [lay]}]).encode(),
            }
        )
    )
    with pytest.raises(Invalid, match="does not match its name"):
        fetch(f"docker-archive:{archive}", store)


def test_a_docker_archive_of_compressed_layers_and_shared_links_is_read(
    tmp_path: Path, store: BlobStore
) -> None:
    """Newer Docker (the containerd store) saves layers as they were pulled, compressed;
    old Docker saves a layer two images share once, the other a symlink to it."""
    zipped = gzip.compress(BASE.tar)
    img = oi.image([BASE, BASE])
    blob = f"blobs/sha256/{oi.digest_of(zipped)[7:]}"
    archive = tmp_path / "saved.tar"
    archive.write_bytes(
        oi.tar_of(
            {
                f"blobs/sha256/{img.config.digest[7:]}": img.config.data,
                blob: zipped,
                "again/layer.tar": oi.Symlink(f"../{blob}"),
                "manifest.json": json.dumps(
                    [
                        {
                            "Config": f"blobs/sha256/{img.config.digest[7:]}",
                            "Layers": [blob, "again/layer.tar"],
                        }
                    ]
                ).encode(),
            }
        )
    )
    got = fetch(f"docker-archive:{archive}", store)
    assert [b.media_type for b in got.layers] == [f"{oi.OCI_LAYER}+gzip"] * 2
    assert layers_of(got) == [zipped, zipped]
    # A compressed layer whose content is not its diff_id is refused all the same.
    bad = tmp_path / "bad.tar"
    other = gzip.compress(oi.tar_of({"x": b"x"}))
    bad.write_bytes(
        oi.tar_of(
            {
                "c.json": oi.image([BASE]).config.data,
                "l.tar": other,
                "manifest.json": json.dumps([{"Config": "c.json", "Layers": ["l.tar"]}]).encode(),
            }
        )
    )
    fresh = BlobStore(tmp_path / "fresh")
    with pytest.raises(Invalid, match="diff_id"):
        fetch(f"docker-archive:{bad}", fresh)
    assert not any(fresh.blobs_dir.iterdir()) and clean(fresh)


def test_a_docker_archive_with_a_hostile_manifest_json_is_refused(
    tmp_path: Path, store: BlobStore
) -> None:
    for body, words in (
        (b"[" * 100_000, "nested"),
        (json.dumps([{"Config": "c.json", "Layers": ["l"] * 300}]).encode(), "at most"),
        (json.dumps({"Config": "c.json"}).encode(), "list"),
    ):
        archive = tmp_path / "saved.tar"
        archive.write_bytes(oi.tar_of({"manifest.json": body}))
        with pytest.raises(Invalid, match=words):
            fetch(f"docker-archive:{archive}", store)
    assert clean(store)


def test_two_imports_of_one_image_at_once_both_succeed_and_store_it_once(
    tmp_path: Path, store: BlobStore
) -> None:
    big = oi.layer({"big": os.urandom(4 << 20)}, "none")
    img = oi.image([BASE, big])
    archive = oi.write_oci_archive(tmp_path / "image.tar", {"app": img})
    results: list[FetchedImage | BaseException] = []

    def run() -> None:
        try:
            results.append(fetch(f"oci-archive:{archive}:app", store))
        except BaseException as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, FetchedImage) for r in results), results
    assert {r.manifest_digest for r in results} == {img.manifest.digest}  # type: ignore[union-attr]
    assert sorted(p.name for p in store.blobs_dir.iterdir()) == sorted(
        b.digest[7:] for b in (*img.blobs(), img.manifest)
    )
    assert store.total_bytes() == sum(b.size for b in (*img.blobs(), img.manifest))
    assert clean(store)


# ---------------------------------------------------------------------- a Docker Engine


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@contextlib.contextmanager
def fake_engine(images: dict[str, bytes], exports: list[str] | None = None) -> Iterator[str]:
    """A Docker Engine's routes an import uses, on a unix socket: ``GET
    /images/{name}/json`` (its id: its config's digest) and ``/images/{name}/get`` (its
    ``docker save`` archive); each export asked for is appended to ``exports``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.removeprefix("/images/").removesuffix("/get").removesuffix("/json")
            body = images.get(name)
            if body is not None and self.path.endswith("/json"):
                body = json.dumps({"Id": _config_digest(body)}).encode()
            elif body is not None and exports is not None:
                exports.append(name)
            status = 200 if body is not None else 404
            if body is None:
                body = json.dumps({"message": f"No such image: {name}"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def address_string(self) -> str:
            return "unix"

        def log_message(self, *_: Any) -> None:
            pass

    directory = Path(tempfile.mkdtemp(prefix="forkd-engine-", dir="/tmp"))
    path = directory / "docker.sock"
    server = _UnixHTTPServer(str(path), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(directory, ignore_errors=True)


def _config_digest(archive: bytes) -> str:
    """The config digest of the one image a ``docker save`` archive holds."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        entry = json.load(tar.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = tar.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
    return "sha256:" + hashlib.sha256(config).hexdigest()


def test_an_image_of_the_docker_engine_is_exported_and_read(
    tmp_path: Path, store: BlobStore
) -> None:
    saved = oi.write_docker_archive(tmp_path / "saved.tar", {"myapp:1": APP}).read_bytes()
    exports: list[str] = []
    with fake_engine({"myapp:1": saved}, exports) as host:
        said: list[str] = []
        got = fetch("docker-daemon:myapp:1", store, docker_host=host, progress=said.append)
        assert got.reference == "docker-daemon:myapp:1"
        assert got.config_digest == APP.config.digest and got.config.working_dir == "/app"
        assert any("exporting myapp:1" in m for m in said) and exports == ["myapp:1"]
        # Issue 36, item 6: the same image id again is not exported again.
        said.clear()
        again = fetch("docker-daemon:myapp:1", store, docker_host=host, progress=said.append)
        assert exports == ["myapp:1"] and any("nothing to export" in m for m in said)
        assert (again.config_digest, again.manifest_digest) == (
            got.config_digest,
            got.manifest_digest,
        )
        assert [b.diff_id for b in again.layers] == [b.diff_id for b in got.layers]
        assert again.bytes_fetched == 0
        with pytest.raises(NotFound, match="myapp:2"):
            fetch("docker-daemon:myapp:2", store, docker_host=host)
    with pytest.raises(Unavailable):
        fetch("docker-daemon:myapp:1", store, docker_host=f"unix://{tmp_path}/none.sock")
    assert clean(store)  # the exported archive is gone too
