"""Images fetched from a real registry (Debian's docker-registry on loopback) into the blob
store, no VM: every layer compression, indexes and the linux/amd64 pick, Docker's
formats, what a second import fetches, and every way a registry can fail or lie (a
fake one on loopback for the lies), each leaving no temporary file behind."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from forkd.errors import Invalid, NotFound, UpstreamError, UpstreamRefused
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.fetch import fetch_image
from forkd.image_import.model import FetchedImage
from forkd.image_import.references import FORMS
from forkd.oci.auth import Credentials
from forkd.oci.policy import RegistryPolicy
from tests import oci_images as oi
from tests.registry_server import RegistryServer

NO_CREDENTIALS = lambda _registry: None  # noqa: E731  (never the host's docker config)
BASE = oi.layer({"etc/": oi.Dir(), "etc/os-release": b"ID=forkd-test\n", "bin/sh": b"#!\n"})
APP_CONFIG = {
    "Env": ["PATH=/usr/bin:/bin", "APP=1"],
    "WorkingDir": "/srv",
    "User": "1000:1000",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["exec app"],
    "ExposedPorts": {"8080/tcp": {}, "443/tcp": {}},
    "Labels": {"org.example": "yes"},
    "StopSignal": "SIGINT",
}


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    s = RegistryServer()
    yield s
    s.stop()


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def fetch(ref: str, store: BlobStore, policy: RegistryPolicy, **kw: Any) -> FetchedImage:
    return fetch_image(ref, store, policy=policy, credentials_for=NO_CREDENTIALS, **kw)


def no_temp_files(store: BlobStore) -> bool:
    return not store.tmp_dir.exists() or not any(store.tmp_dir.iterdir())


def test_an_image_of_gzip_zstd_and_plain_layers_is_fetched_whole_and_checked(
    registry: RegistryServer, store: BlobStore
) -> None:
    layers = [BASE, oi.layer({"srv/app": b"x" * 5000}, "zstd"), oi.layer({"a": b"b"}, "none")]
    img = oi.image(layers, APP_CONFIG)
    oi.push(registry.address, "fetch/app", "1", img)
    said: list[str] = []
    got = fetch(registry.ref("fetch/app", "1"), store, registry.policy(), progress=said.append)
    assert got.reference == registry.ref("fetch/app", "1")
    assert got.manifest_digest == img.manifest.digest
    assert got.config_digest == img.config.digest
    c = got.config
    assert c.env == ("PATH=/usr/bin:/bin", "APP=1") and c.working_dir == "/srv"
    assert c.user == "1000:1000" and c.entrypoint == ("/bin/sh", "-c") and c.cmd == ("exec app",)
    assert c.exposed_ports == ("443/tcp", "8080/tcp")  # sorted
    assert c.labels == {"org.example": "yes"} and c.stop_signal == "SIGINT"
    assert [(b.digest, b.size, b.media_type) for b in got.layers] == [
        (lay.digest, lay.size, lay.media_type) for lay in layers
    ]
    for blob, lay in zip(got.layers, layers, strict=True):
        assert blob.path.read_bytes() == lay.data  # the bottom layer first
    total = img.manifest.size + img.config.size + sum(lay.size for lay in layers)
    assert got.bytes_fetched == total and got.bytes_reused == 0
    assert store.has(img.manifest.digest) and store.has(img.config.digest)
    assert said[0] == "manifest" and any(m.startswith("layer 2/3 sha256:") for m in said)
    assert no_temp_files(store)


def test_a_second_import_fetches_only_the_manifest(
    registry: RegistryServer, store: BlobStore
) -> None:
    layers = [BASE, oi.layer({"big": bytes(300_000)})]
    img = oi.image(layers, APP_CONFIG)
    oi.push(registry.address, "fetch/again", "1", img)
    first = fetch(registry.ref("fetch/again", "1"), store, registry.policy())
    before = {p.name: p.stat().st_mtime_ns for p in store.blobs_dir.iterdir()}
    said: list[str] = []
    again = fetch(registry.ref("fetch/again", "1"), store, registry.policy(), progress=said.append)
    assert again == first.__class__(
        **{
            **first.__dict__,
            "bytes_fetched": again.bytes_fetched,
            "bytes_reused": again.bytes_reused,
        }
    )
    assert again.bytes_fetched == img.manifest.size  # no blob fetched
    assert again.bytes_reused == img.config.size + sum(lay.size for lay in layers)
    assert sum("cached" in m for m in said) == 2
    # No layer was written again either.
    assert {p.name: p.stat().st_mtime_ns for p in store.blobs_dir.iterdir()} == before


def test_an_image_sharing_a_base_fetches_only_its_own_layers(
    registry: RegistryServer, store: BlobStore
) -> None:
    base = oi.layer({"usr/lib/big": bytes(range(256)) * 4000})
    one = oi.image([base, oi.layer({"one": b"1"})])
    two = oi.image([base, oi.layer({"two": b"2" * 1000})], {"Cmd": ["two"]})
    oi.push(registry.address, "fetch/one", "1", one)
    oi.push(registry.address, "fetch/two", "1", two)
    fetch(registry.ref("fetch/one", "1"), store, registry.policy())
    got = fetch(registry.ref("fetch/two", "1"), store, registry.policy())
    own = two.layers[1]
    assert got.bytes_fetched == two.manifest.size + two.config.size + own.size
    assert got.bytes_reused == base.size
    assert got.layers[0].path == store.path(base.digest)


def test_an_index_gives_its_linux_amd64_image(registry: RegistryServer, store: BlobStore) -> None:
    arm = oi.image([oi.layer({"arm": b"arm"})], {"Cmd": ["arm"]}, platform="linux/arm64/v8")
    amd = oi.image([oi.layer({"amd": b"amd"})], {"Cmd": ["amd"]})
    idx = oi.index({"linux/arm64/v8": arm, "linux/amd64": amd})
    oi.push(registry.address, "fetch/multi", "1", idx)
    got = fetch(registry.ref("fetch/multi", "1"), store, registry.policy())
    assert got.config.cmd == ("amd",) and got.manifest_digest == amd.manifest.digest
    assert got.bytes_fetched == idx.manifest.size + amd.manifest.size + amd.config.size + (
        amd.layers[0].size
    )
    assert not store.has(arm.config.digest) and not store.has(arm.layers[0].digest)


def test_docker_manifests_and_manifest_lists_are_read(
    registry: RegistryServer, store: BlobStore
) -> None:
    amd = oi.image([oi.layer({"d": b"d"}, docker=True)], {"Cmd": ["docker"]}, docker=True)
    arm = oi.image([oi.layer({"e": b"e"}, docker=True)], platform="linux/arm", docker=True)
    listed = oi.index({"linux/arm": arm, "linux/amd64": amd}, docker=True)
    oi.push(registry.address, "fetch/docker", "list", listed)
    got = fetch(registry.ref("fetch/docker", "list"), store, registry.policy())
    assert got.config.cmd == ("docker",)
    assert got.layers[0].media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip"
    # By digest, as a user pins it.
    pinned = f"{registry.address}/fetch/docker@{amd.manifest.digest}"
    assert fetch(pinned, store, registry.policy()).manifest_digest == amd.manifest.digest


def test_an_index_without_linux_amd64_names_the_platforms_it_has(
    registry: RegistryServer, store: BlobStore
) -> None:
    arm = oi.image([oi.layer({"arm": b"arm"})], platform="linux/arm64")
    s390 = oi.image([oi.layer({"s": b"s"})], platform="linux/s390x")
    oi.push(
        registry.address, "fetch/armonly", "1", oi.index({"linux/arm64": arm, "linux/s390x": s390})
    )
    with pytest.raises(Invalid) as exc:
        fetch(registry.ref("fetch/armonly", "1"), store, registry.policy())
    assert "linux/amd64" in str(exc.value)
    assert "linux/arm64" in str(exc.value) and "linux/s390x" in str(exc.value)
    assert not store.has(arm.config.digest) and no_temp_files(store)


def test_an_amd64_only_manifest_of_another_architecture_is_refused(
    registry: RegistryServer, store: BlobStore
) -> None:
    arm = oi.image([oi.layer({"arm": b"arm"})], platform="linux/arm64")
    oi.push(registry.address, "fetch/armimage", "1", arm)
    with pytest.raises(Invalid, match="linux/arm64"):
        fetch(registry.ref("fetch/armimage", "1"), store, registry.policy())
    assert not store.has(arm.layers[0].digest)


def test_an_unknown_tag_or_repository_is_not_found_naming_it(
    registry: RegistryServer, store: BlobStore
) -> None:
    oi.push(registry.address, "fetch/known", "1", oi.image([BASE]))
    for ref in (registry.ref("fetch/known", "nope"), registry.ref("fetch/unknown", "1")):
        with pytest.raises(NotFound) as exc:
            fetch(ref, store, registry.policy())
        assert ref in str(exc.value)
    assert not store.blobs_dir.exists() or not any(store.blobs_dir.iterdir())


def test_a_short_name_resolves_only_through_the_default_registry(
    registry: RegistryServer, store: BlobStore
) -> None:
    oi.push(registry.address, "team/app", "2", oi.image([BASE], {"Cmd": ["short"]}))
    with pytest.raises(Invalid, match="--default-registry"):
        fetch("team/app:2", store, registry.policy())  # nothing looked up
    policy = RegistryPolicy.of([registry.address], default=registry.address)
    got = fetch("team/app:2", store, policy)
    assert got.config.cmd == ("short",) and got.reference == registry.ref("team/app", "2")


def test_a_registry_that_wants_credentials_refuses_without_and_serves_with_them(
    store: BlobStore,
) -> None:
    private = RegistryServer(user="ann", password="s3cret")
    try:
        img = oi.image([BASE], {"Cmd": ["private"]})
        oi.push(private.address, "fetch/private", "1", img, auth=("ann", "s3cret"))
        ref = private.ref("fetch/private", "1")
        with pytest.raises(UpstreamRefused) as exc:
            fetch(ref, store, private.policy())
        assert "401" in str(exc.value) and "s3cret" not in str(exc.value)
        wrong = lambda _r: Credentials("ann", "wrong")  # noqa: E731
        with pytest.raises(UpstreamRefused):
            fetch_image(ref, store, policy=private.policy(), credentials_for=wrong)
        asked: list[str] = []

        def right(registry: str) -> Credentials:
            asked.append(registry)
            return Credentials("ann", "s3cret")

        got = fetch_image(ref, store, policy=private.policy(), credentials_for=right)
        assert got.config.cmd == ("private",) and asked == [private.address]
        assert no_temp_files(store)
    finally:
        private.stop()


def test_an_unreachable_registry_is_an_upstream_error(store: BlobStore) -> None:
    policy = RegistryPolicy.of(["127.0.0.1:1"])  # listed; nothing listens there
    with pytest.raises(UpstreamError, match="unreachable"):
        fetch("127.0.0.1:1/some/image:1", store, policy)
    assert no_temp_files(store)


def test_a_registry_on_this_host_not_listed_is_refused_before_any_connection(
    registry: RegistryServer, store: BlobStore
) -> None:
    with pytest.raises(Invalid, match="insecure-registry"):
        fetch(registry.ref("fetch/app", "1"), store, RegistryPolicy())


@pytest.mark.parametrize(
    "text",
    [
        "",
        "UPPER/case:1",
        "127.0.0.1:5000/repo:bad tag",
        "127.0.0.1:5000/repo@sha256:abc",
        "https://127.0.0.1:5000/repo",
        "127.0.0.1:99999/repo:1",
        "x" * 5000,
        "oci:",
        "docker-daemon:Not Valid",
        "127.0.0.1:5000/repo:" + "t" * 200,
    ],
)
def test_a_malformed_reference_is_invalid_listing_the_forms(text: str, store: BlobStore) -> None:
    with pytest.raises(Invalid) as exc:
        fetch(text, store, RegistryPolicy.of(["127.0.0.1:5000"]))
    # (pytest.raises(Invalid) lets no RecursionError through.) A Docker Engine name is
    # refused by the engine's rule, "invalid image name ...", without the forms.
    if not text.startswith("docker-daemon:"):
        assert FORMS in str(exc.value)
    assert not store.root.exists()


# ---------------------------------------------------------------------- a lying registry


@dataclass
class Served:
    """What the fake registry answers: path → (status, content type, body)."""

    routes: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    length: dict[str, int] = field(default_factory=dict)  # a Content-Length that lies
    headers: list[dict[str, str]] = field(default_factory=list)  # of each request
    # path → seconds between bytes: its answer (headers too with trickle_headers) is
    # sent a byte at a time, never quiet long enough to trip a read timeout
    trickle: dict[str, float] = field(default_factory=dict)
    trickle_headers: bool = False


class _Handler(BaseHTTPRequestHandler):
    served: Served

    def do_GET(self) -> None:
        self.served.requests.append(self.path)
        self.served.headers.append(dict(self.headers))
        status, kind, body = self.served.routes.get(self.path, (404, "text/plain", b"{}"))
        if self.path in self.served.trickle:
            self._trickle(self.served.trickle[self.path], kind, body)
            return
        self.send_response(status)
        if status == 307:  # the body names where to
            self.send_header("Location", body.decode())
            body = b""
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(self.served.length.get(self.path, len(body))))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a reader gave up
            self.wfile.write(body)

    def _trickle(self, every: float, kind: str, body: bytes) -> None:
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        slow = (head if self.served.trickle_headers else b"") + body
        try:
            if not self.served.trickle_headers:
                self.wfile.write(head)
            for i in range(len(slow)):
                self.wfile.write(slow[i : i + 1])
                self.wfile.flush()
                time.sleep(every)
        except (BrokenPipeError, ConnectionResetError):  # the reader gave up: as it should
            pass

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def liar() -> Iterator[tuple[str, Served]]:
    served = Served()
    handler = type("Handler", (_Handler,), {"served": served})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", served
    server.shutdown()
    server.server_close()


def _serve(served: Served, img: oi.Image, repo: str = "lie", tag: str = "1") -> None:
    served.routes[f"/v2/{repo}/manifests/{tag}"] = (200, img.manifest.media_type, img.manifest.data)
    served.routes[f"/v2/{repo}/manifests/{img.manifest.digest}"] = (
        200,
        img.manifest.media_type,
        img.manifest.data,
    )
    for blob in img.blobs():
        served.routes[f"/v2/{repo}/blobs/{blob.digest}"] = (
            200,
            "application/octet-stream",
            blob.data,
        )


def _fails(address: str, store: BlobStore, error: type[Exception], ref: str = "lie:1") -> str:
    with pytest.raises(error) as exc:
        fetch(f"{address}/{ref}", store, RegistryPolicy.of([address]))
    assert no_temp_files(store)
    return str(exc.value)


def test_a_layer_with_other_bytes_than_its_digest_is_refused_and_not_kept(
    liar: tuple[str, Served], store: BlobStore
) -> None:
    address, served = liar
    good = oi.layer({"good": b"g" * 4000})
    img = oi.image([good])
    _serve(served, img)
    evil = bytearray(good.data)
    evil[-10] ^= 0xFF  # same size, other bytes
    served.routes[f"/v2/lie/blobs/{good.digest}"] = (200, "application/octet-stream", bytes(evil))
    assert "wrong content" in _fails(address, store, UpstreamError)
    assert not store.has(good.digest)
    # Longer than the manifest says: cut off at the size, nothing kept.
    served.routes[f"/v2/lie/blobs/{good.digest}"] = (200, "x", good.data + b"more")
    _fails(address, store, UpstreamError)
    # Shorter.
    served.routes[f"/v2/lie/blobs/{good.digest}"] = (200, "x", good.data[:-1])
    _fails(address, store, UpstreamError)
    assert not store.has(good.digest)


def test_a_config_or_manifest_that_is_not_its_digest_is_refused(
    liar: tuple[str, Served], store: BlobStore
) -> None:
    address, served = liar
    img = oi.image([oi.layer({"a": b"a"})])
    _serve(served, img)
    served.routes[f"/v2/lie/blobs/{img.config.digest}"] = (200, "x", img.config.data[:-1] + b" ")
    _fails(address, store, UpstreamError)
    assert not store.has(img.config.digest)
    # A manifest asked for by digest that comes back as other bytes.
    other = oi.image([oi.layer({"b": b"b"})])
    _serve(served, img)
    served.routes[f"/v2/lie/manifests/{img.manifest.digest}"] = (
        200,
        oi.OCI_MANIFEST,
        other.manifest.data,
    )
    assert "not sha256:" in _fails(address, store, UpstreamError, f"lie@{img.manifest.digest}")
    # An index's entry whose manifest is not what the index says.
    idx = oi.index({"linux/amd64": img})
    served.routes["/v2/lie/manifests/multi"] = (200, oi.OCI_INDEX, idx.manifest.data)
    _fails(address, store, UpstreamError, "lie:multi")


def test_a_huge_manifest_is_refused_before_it_is_read(
    liar: tuple[str, Served], store: BlobStore
) -> None:
    address, served = liar
    huge = b'{"schemaVersion": 2, "x": "' + b"a" * (5 << 20) + b'"}'
    served.routes["/v2/lie/manifests/1"] = (200, oi.OCI_MANIFEST, huge)
    assert "bytes" in _fails(address, store, UpstreamError)
    # Without a Content-Length that says so: cut off after the limit all the same.
    served.length["/v2/lie/manifests/1"] = 100
    served.routes["/v2/lie/manifests/1"] = (200, oi.OCI_MANIFEST, huge)
    _fails(address, store, (UpstreamError, Invalid))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested"),
        (b"not json", "JSON"),
        (b'{"schemaVersion": 1, "name": "x", "fsLayers": []}', "schema 1"),
        (
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": oi.OCI_MANIFEST,
                    "config": {
                        "mediaType": "application/vnd.forkd.snapshot.config.v1+json",
                        "digest": "sha256:" + "a" * 64,
                        "size": 2,
                    },
                    "layers": [],
                }
            ).encode(),
            "not a container image",
        ),
        (
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": oi.OCI_MANIFEST,
                    "config": {
                        "mediaType": oi.OCI_CONFIG,
                        "digest": "sha512:" + "a" * 128,
                        "size": 2,
                    },
                    "layers": [],
                }
            ).encode(),
            "sha256",
        ),
        (
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": oi.OCI_MANIFEST,
                    "config": {
                        "mediaType": oi.OCI_CONFIG,
                        "digest": "sha256:" + "a" * 64,
                        "size": -1,
                    },
                    "layers": [],
                }
            ).encode(),
            "size",
        ),
    ],
)
def test_a_hostile_manifest_is_a_clear_error(
    liar: tuple[str, Served], store: BlobStore, body: bytes, words: str
) -> None:
    address, served = liar
    served.routes["/v2/lie/manifests/1"] = (200, oi.OCI_MANIFEST, body)
    assert words in _fails(address, store, Invalid)
    assert not any(r.startswith("/v2/lie/blobs/") for r in served.requests)  # nothing fetched


def _manifest_with_layers(layers: list[dict[str, Any]]) -> bytes:
    config = {"mediaType": oi.OCI_CONFIG, "digest": "sha256:" + "c" * 64, "size": 10}
    return json.dumps(
        {"schemaVersion": 2, "mediaType": oi.OCI_MANIFEST, "config": config, "layers": layers}
    ).encode()


@pytest.mark.parametrize(
    ("layers", "words"),
    [
        (
            [{"mediaType": f"{oi.OCI_LAYER}+gzip", "digest": "sha256:" + "d" * 64, "size": 1}]
            * 257,
            "at most 256",
        ),
        (
            [
                {
                    "mediaType": "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
                    "digest": "sha256:" + "d" * 64,
                    "size": 1,
                }
            ],
            "foreign",
        ),
        (
            [
                {
                    "mediaType": "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                    "digest": "sha256:" + "d" * 64,
                    "size": 1,
                }
            ],
            "foreign",
        ),
        (
            [{"mediaType": "application/x-squashfs", "digest": "sha256:" + "d" * 64, "size": 1}],
            "tar",
        ),
        (
            [
                {
                    "mediaType": f"{oi.OCI_LAYER}+gzip",
                    "digest": "sha256:" + "d" * 64,
                    "size": 1 << 50,
                }
            ],
            "more than",
        ),
    ],
)
def test_layers_too_many_too_large_or_not_tars_are_refused_before_any_is_fetched(
    liar: tuple[str, Served], store: BlobStore, layers: list[dict[str, Any]], words: str
) -> None:
    address, served = liar
    served.routes["/v2/lie/manifests/1"] = (200, oi.OCI_MANIFEST, _manifest_with_layers(layers))
    assert words in _fails(address, store, Invalid)
    assert not any(r.startswith("/v2/lie/blobs/") for r in served.requests)


def test_a_config_whose_diff_ids_do_not_count_the_layers_is_refused(
    liar: tuple[str, Served], store: BlobStore
) -> None:
    address, served = liar
    lay = oi.layer({"a": b"a"})
    img = oi.image([lay], diff_ids=[lay.diff_id, lay.diff_id])
    _serve(served, img)
    assert "diff_ids" in _fails(address, store, Invalid)
    assert not store.has(lay.digest)


def test_a_layer_redirected_to_blob_storage_is_streamed_from_there_without_credentials(
    liar: tuple[str, Served], store: BlobStore
) -> None:
    address, served = liar
    lay = oi.layer({"big": bytes(3 << 20)}, "none")
    img = oi.image([lay])
    _serve(served, img)
    served.routes["/storage/blob?signed=1"] = served.routes[f"/v2/lie/blobs/{lay.digest}"]
    served.routes[f"/v2/lie/blobs/{lay.digest}"] = (307, "x", b"/storage/blob?signed=1")
    got = fetch_image(
        f"{address}/lie:1",
        store,
        policy=RegistryPolicy.of([address]),
        credentials_for=lambda _r: Credentials(bearer="tok"),
    )
    assert got.layers[0].path.read_bytes() == lay.data
    asked = dict(zip(served.requests, served.headers, strict=True))
    assert asked[f"/v2/lie/blobs/{lay.digest}"].get("Authorization") == "Bearer tok"
    assert "Authorization" not in asked["/storage/blob?signed=1"]


@pytest.mark.parametrize("headers", [False, True], ids=["body", "headers"])
def test_a_registry_trickling_a_blob_is_cut_off_at_the_deadline(
    liar: tuple[str, Served], store: BlobStore, monkeypatch: pytest.MonkeyPatch, headers: bool
) -> None:
    # A byte every 0.2 s never trips a read timeout (30 s); 4,000 of them would take 13
    # minutes. The deadline (1.5 s here, 60 s plus a second a MiB in the daemon) is held
    # on the wire, whatever the pattern, in the answer's headers as in its body.
    monkeypatch.setattr("forkd.oci.registry.BLOB_DEADLINE_SECS", 1.5)
    address, served = liar
    lay = oi.layer({"slow": b"s" * 4000}, "none")
    img = oi.image([lay])
    _serve(served, img)
    served.trickle[f"/v2/lie/blobs/{lay.digest}"] = 0.2
    served.trickle_headers = headers
    started = time.monotonic()
    assert "too slow" in _fails(address, store, UpstreamError)
    assert time.monotonic() - started < 6
    assert not store.has(lay.digest)
