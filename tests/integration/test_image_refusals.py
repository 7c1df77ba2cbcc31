"""Image references a daemon refuses, through its HTTP API, each with its own status and
nothing left behind (no image built, no blob kept, no partial blob, no snapshot): unknown
tags, repositories and Docker Engine images (404 naming the reference), a registry that
wants a password (403, and an import once the daemon has the right one), an unreachable
registry (502), malformed references and archives outside ``--image-archive-dir`` (400);
and hostile images (a layer climbing out with ``../``, hard links to host files, a gzip
bomb past ``--max-image-mib``, descriptors that lie about a blob's size or digest, a huge
manifest, a deeply nested config) refused with nothing written outside the cache, while
names a container runtime confines (absolute paths, symlinks out of the root) are
confined inside the image."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import tarfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd import paths
from forkd.client import Controller, ControllerError
from tests import docker_daemon, oci_images
from tests.archive import hostile
from tests.docker_daemon import DockerDaemon
from tests.integration.conftest import Daemon
from tests.integration.image_env import CLOSED, CacheState, image_daemon
from tests.registry_server import RegistryServer, free_address

pytestmark = pytest.mark.integration

MAX_IMAGE_MIB = 64  # the daemon's cap on an image's expanded size, low to make a bomb quick
PRIVATE = free_address()  # a registry that wants a password, started by its test


@pytest.fixture(scope="module")
def docker() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    server = RegistryServer()
    oci_images.push(server.address, "refusals/app", "1", small_image())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def archive_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archives")


@pytest.fixture(scope="module")
def daemon(docker: DockerDaemon, registry: RegistryServer, archive_dir: Path) -> Iterator[Daemon]:
    with image_daemon(
        docker, [registry.address, PRIVATE], archive_dir, "--max-image-mib", str(MAX_IMAGE_MIB)
    ) as d:
        yield d


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=600) as c:
        yield c


def small_image(extra: dict[str, oci_images.Entry] | None = None) -> oci_images.Image:
    files: dict[str, oci_images.Entry] = {"srv": oci_images.Dir(), "srv/hello.txt": b"hi\n"}
    return oci_images.image([oci_images.layer({**files, **(extra or {})})], {"Cmd": ["true"]})


def raw_image(tar: bytes) -> oci_images.Image:
    """An image of one gzip layer holding ``tar`` as it is (hostile, hand-made)."""
    layer = oci_images.Layer(gzip.compress(tar, mtime=0), f"{oci_images.OCI_LAYER}+gzip", tar)
    return oci_images.image([layer], {"Cmd": ["true"]})


def refused(
    ctl: Controller, ref: str, *, via_snapshot: bool = False, what: str = ""
) -> ControllerError:
    """Import ``ref`` (or make a snapshot of it): it must fail and leave the cache and
    the daemon's snapshots as they were."""
    before = CacheState.now()
    with pytest.raises(ControllerError) as exc:
        if via_snapshot:
            ctl.create_snapshot("never", image=ref, start=True, ready_port=80)
        else:
            imported = ctl.import_image(ref)
            pytest.fail(f"{what or ref} was imported: {imported}")
    assert CacheState.now() == before, ref
    assert "never" not in {s["tag"] for s in ctl.list_snapshots()}
    return exc.value


def test_unknown_references_are_404s_naming_them(
    ctl: Controller, registry: RegistryServer, archive_dir: Path
) -> None:
    oci_images.write_oci_layout(archive_dir / "layout", {"1": small_image()})
    for ref, named in (
        (registry.ref("refusals/app", "no-such-tag"), "no-such-tag"),
        (registry.ref("refusals/no-such-repo", "1"), "refusals/no-such-repo"),
        ("docker-daemon:forkd-test/no-such-image:1", "forkd-test/no-such-image:1"),
        (f"oci-archive:{archive_dir / 'missing.tar'}", "missing.tar"),
        (f"oci:{archive_dir / 'layout'}:no-such-tag", "no-such-tag"),
    ):
        error = refused(ctl, ref, via_snapshot=ref.startswith("127."))
        assert error.status == 404, (ref, error)
        assert named in str(error), (ref, error)


def test_a_registry_that_wants_a_password(ctl: Controller, daemon: Daemon) -> None:
    private = RegistryServer(user="ann", password="s3cret", address=PRIVATE)
    auth_file = daemon.root / "docker.json"
    try:
        oci_images.push(private.address, "team/app", "1", small_image(), auth=("ann", "s3cret"))
        ref = private.ref("team/app", "1")
        assert refused(ctl, ref).status == 403  # no credentials
        auth_file.write_text(
            json.dumps({"auths": {PRIVATE: {"username": "ann", "password": "wrong"}}})
        )
        assert refused(ctl, ref, via_snapshot=True).status == 403
        auth_file.write_text(
            json.dumps({"auths": {PRIVATE: {"username": "ann", "password": "s3cret"}}})
        )
        assert ctl.import_image(ref)["id"] == small_image().config.digest
    finally:
        auth_file.unlink(missing_ok=True)
        private.stop()


def test_unreachable_malformed_and_unlisted_references(
    ctl: Controller, archive_dir: Path, tmp_path: Path
) -> None:
    outside = oci_images.write_oci_archive(tmp_path / "outside.tar", {"1": small_image()})
    (archive_dir / "link.tar").symlink_to(outside)  # inside the directory, a file outside it
    cases = [
        (f"{CLOSED}/refusals/app:1", 502),
        ("Not A Ref", 400),
        ("nosuchtransport://x", 400),
        ("python:3.12", 400),  # no --default-registry: a short name reaches nothing
        ("127.0.0.1:2/refusals/app:1", 400),  # on loopback and not listed: never contacted
        (f"oci-archive:{outside}:1", 400),
        (f"oci-archive:{archive_dir / 'link.tar'}:1", 400),
        ("docker-archive:/etc/passwd", 400),
        (f"oci:{archive_dir / '..'}", 400),
    ]
    for ref, status in cases:
        error = refused(ctl, ref, via_snapshot=status == 502)
        assert error.status == status, (ref, error)


def bomb_layer(expanded: int) -> bytes:
    """A gzip stream of ``expanded`` bytes of tar: one 1 MiB file of zeros after another,
    all of one name, in about a thousandth of that."""
    entry = hostile.archive(hostile.file("z", bytes(1 << 20)), fmt=tarfile.USTAR_FORMAT)
    entry = entry[: 512 + (1 << 20)]  # its header and data, without the end of archive
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(
        [*(compressor.compress(entry) for _ in range(expanded >> 20)), compressor.flush()]
    )


def bomb_diff_id(expanded: int) -> str:
    """The digest of the tar :func:`bomb_layer` expands to."""
    entry = hostile.archive(hostile.file("z", bytes(1 << 20)), fmt=tarfile.USTAR_FORMAT)
    h = hashlib.sha256()
    for _ in range(expanded >> 20):
        h.update(entry[: 512 + (1 << 20)])
    return "sha256:" + h.hexdigest()


def test_hostile_images_are_refused_and_write_nothing_outside(
    ctl: Controller, archive_dir: Path, tmp_path: Path
) -> None:
    escape = tmp_path / "escaped"
    climb = "../" * 16 + str(escape).lstrip("/")
    cases = {
        "climbs": raw_image(hostile.archive(hostile.file(f"{climb}/pwned", b"out"))),
        "links-host-file": raw_image(hostile.archive(hostile.hardlink("steal", "/etc/passwd"))),
        "links-out": raw_image(hostile.archive(hostile.hardlink("steal", "../../etc/passwd"))),
    }
    for name, img in cases.items():
        path = oci_images.write_oci_archive(archive_dir / f"{name}.tar", {"1": img})
        error = refused(ctl, f"oci-archive:{path}:1", via_snapshot=name == "climbs")
        assert error.status == 400, (name, error)
        assert not escape.exists(), name

    # A layer that expands past the daemon's cap: refused once it passes it, not at its end.
    # Its diff_id is true (the tar's digest), so the layer passes its check while it is
    # fetched and meets the cap where the layers are merged.
    data, diff_id = bomb_layer(1 << 30), bomb_diff_id(1 << 30)
    layer = oci_images.Layer(data, f"{oci_images.OCI_LAYER}+gzip", b"")
    bomb = oci_images.image([layer], {"Cmd": ["true"]}, diff_ids=[diff_id])
    path = oci_images.write_oci_archive(archive_dir / "bomb.tar", {"1": bomb})
    started = time.monotonic()
    error = refused(ctl, f"oci-archive:{path}:1")
    elapsed = time.monotonic() - started
    assert error.status == 400 and f"{MAX_IMAGE_MIB << 20}" in str(error).replace(",", ""), error
    print(
        f"a {len(data) >> 20} MiB gzip bomb of 1 GiB refused at {MAX_IMAGE_MIB} MiB "
        f"in {elapsed:.1f} s"
    )
    assert elapsed < 60


def test_names_a_runtime_confines_stay_inside_the_image(
    ctl: Controller, archive_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    tar = hostile.archive(
        hostile.file(f"{outside}/absolute", b"absolute name\n"),  # a leading / is the root's
        hostile.symlink("link", str(outside)),
        hostile.file("link/through", b"through a symlink\n"),  # the link resolves in the image
    )
    path = oci_images.write_oci_archive(archive_dir / "confined.tar", {"1": raw_image(tar)})
    info = ctl.import_image(f"oci-archive:{path}:1")
    assert not outside.exists()
    rootfs = paths.images_dir() / f"{info['name']}-{info['key']}" / "rootfs.sqfs"
    for name, data in (("absolute", b"absolute name\n"), ("through", b"through a symlink\n")):
        cat = subprocess.run(
            ["rdsquashfs", "-c", f"{outside}/{name}", str(rootfs)], capture_output=True, check=False
        )
        assert cat.returncode == 0 and cat.stdout == data, (name, cat.stderr)
    ctl.delete_image(info["name"])
    assert not rootfs.exists()


def image_with(config: bytes, layer: oci_images.Layer, **manifest: Any) -> oci_images.Image:
    """An image whose config is ``config`` as it is, its manifest's fields ``manifest``."""
    cfg = oci_images.Blob(config, oci_images.OCI_CONFIG)
    doc = {
        "schemaVersion": 2,
        "mediaType": oci_images.OCI_MANIFEST,
        "config": cfg.descriptor(),
        "layers": [layer.descriptor()],
        **manifest,
    }
    body = oci_images.Blob(json.dumps(doc).encode(), oci_images.OCI_MANIFEST)
    return oci_images.Image(cfg, (layer,), body)


def test_lying_huge_and_deep_documents_are_refused(ctl: Controller, archive_dir: Path) -> None:
    good = small_image({"srv/nonce": os.urandom(16)})  # a layer no earlier run left held
    layer, config = good.layers[0], good.config.data
    nested: Any = "deep"
    for _ in range(200):
        nested = {"x": nested}
    deep = json.dumps({**json.loads(config), "deep": nested}).encode()
    cases = {
        "wrong-size": image_with(config, layer, layers=[layer.descriptor(size=layer.size + 1)]),
        "huge-manifest": image_with(config, layer, annotations={"pad": "x" * (5 << 20)}),
        "deep-config": image_with(deep, layer),
        "not-its-digest": good,
    }
    for name, img in cases.items():
        layout = oci_images.write_oci_layout(archive_dir / f"lies-{name}", {"1": img})
        if name == "not-its-digest":  # a blob whose bytes are not what its name says
            blob = layout / "blobs" / "sha256" / layer.digest.removeprefix("sha256:")
            blob.write_bytes(bytes(len(layer.data)))
        error = refused(ctl, f"oci:{layout}:1", what=name)
        assert error.status == 400, (name, error)


def test_an_image_is_exactly_what_its_digests_say_from_every_source(
    ctl: Controller, registry: RegistryServer, archive_dir: Path
) -> None:
    """Image-cache poisoning: an image whose config is byte for byte the real one's, over
    layers of the attacker's, is refused from every source before and after the real
    image is imported, and the real image (pinned by digest too) is its own content."""
    good_layer = oci_images.layer({"etc/": oci_images.Dir(), "etc/marker": b"good\n"})
    evil_layer = oci_images.layer({"etc/": oci_images.Dir(), "etc/marker": b"evil\n"})
    good = oci_images.image([good_layer], {"Cmd": ["true"]})
    body = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": oci_images.OCI_MANIFEST,
            "config": good.config.descriptor(),
            "layers": [evil_layer.descriptor()],
        }
    ).encode()
    evil = oci_images.Image(
        good.config, (evil_layer,), oci_images.Blob(body, oci_images.OCI_MANIFEST)
    )
    for tag, img in (("good", good), ("evil", evil)):
        oci_images.push(registry.address, "poison/app", tag, img)
    sources = {
        "registry": f"{registry.address}/poison/app:evil",
        "registry by digest": f"{registry.address}/poison/app@{evil.manifest.digest}",
        "oci-archive": "oci-archive:"
        + str(oci_images.write_oci_archive(archive_dir / "evil-oci.tar", {"1": evil}))
        + ":1",
        "oci": "oci:"
        + str(oci_images.write_oci_layout(archive_dir / "evil-layout", {"1": evil}))
        + ":1",
    }
    saved = oci_images.write_docker_archive(archive_dir / "evil-save.tar", {"app:1": evil})
    sources["docker-archive"] = f"docker-archive:{saved}"
    loaded = oci_images.write_oci_archive(archive_dir / "evil-load.tar", {"app:1": evil})

    def all_refused() -> None:
        for what, ref in sources.items():
            error = refused(ctl, ref, what=what)
            assert error.status == 400 and "diff_id" in str(error), (what, error)
        before = CacheState.now()
        with pytest.raises(ControllerError) as exc:
            ctl.load_image(loaded, tag="poison:1")
        assert exc.value.status == 400 and "diff_id" in str(exc.value), exc.value
        assert CacheState.now() == before

    def marker(info: dict[str, Any]) -> bytes:
        rootfs = paths.images_dir() / f"{info['name']}-{info['key']}" / "rootfs.sqfs"
        cat = subprocess.run(
            ["rdsquashfs", "-c", "/etc/marker", str(rootfs)], capture_output=True, check=True
        )
        return cat.stdout

    all_refused()  # the attacker first
    info = ctl.import_image(f"{registry.address}/poison/app@{good.manifest.digest}")
    assert marker(info) == b"good\n"
    all_refused()  # and after the real image is in the cache
    again = ctl.import_image(f"{registry.address}/poison/app:good")
    assert (again["name"], again["key"], marker(again)) == (info["name"], info["key"], b"good\n")
    ctl.delete_image(info["name"])
