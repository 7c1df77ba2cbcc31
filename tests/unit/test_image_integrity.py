"""An image is exactly what its digests say (issue 35, image-cache poisoning): an image whose
config is byte for byte another's, with layers of its own, is refused by every source
(a real registry, an OCI layout, an OCI archive, a ``docker save`` archive, an archive
a client sent) in either import order, its layers kept nowhere; the real image then
imports with its own content. A layer blob the store holds already is checked against
the config that names it too, and a build is found again only when its config and
every layer match."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from forkd import paths
from forkd.archive.errors import BadArchive
from forkd.errors import Invalid
from forkd.guest import container_image
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.diff_ids import LayerMismatch, copy_checking_diff_id
from forkd.image_import.fetch import fetch_image
from forkd.image_import.layers import IMAGE_LIMITS, read_layers
from forkd.image_import.local_sources import fetch_loaded
from forkd.image_import.model import FetchedImage, ImageConfig, LayerBlob, RootfsStats
from forkd.oci.policy import RegistryPolicy
from tests import oci_images as oi
from tests.registry_server import RegistryServer
from tests.unit.fake_images import stand_in_boot_parts

NO_CREDENTIALS = lambda _registry: None  # noqa: E731
GOOD_LAYER = oi.layer({"etc/": oi.Dir(), "etc/marker": b"good\n"})
EVIL_LAYER = oi.layer({"etc/": oi.Dir(), "etc/marker": b"evil\n"})
GOOD = oi.image([GOOD_LAYER], {"Cmd": ["/bin/sh"]})


def with_config_of(real: oi.Image, layers: list[oi.Layer], *, docker: bool = False) -> oi.Image:
    """An image whose config is ``real``'s, byte for byte (the same image id), over
    ``layers``: what an attacker publishes to take the real image's place."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": oi.DOCKER_MANIFEST if docker else oi.OCI_MANIFEST,
        "config": real.config.descriptor(),
        "layers": [lay.descriptor() for lay in layers],
    }
    body = json.dumps(manifest, sort_keys=True).encode()
    return oi.Image(real.config, tuple(layers), oi.Blob(body, oi.OCI_MANIFEST))


EVIL = with_config_of(GOOD, [EVIL_LAYER])


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    s = RegistryServer()
    oi.push(s.address, "poison/app", "good", GOOD)
    oi.push(s.address, "poison/app", "evil", EVIL)
    # The attacker's own image, honest about its layer: the evil blob gets into the
    # cache with a config that names it truly.
    oi.push(s.address, "poison/own", "1", oi.image([EVIL_LAYER], {"Cmd": ["x"]}))
    yield s
    s.stop()


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def contents(got: FetchedImage) -> list[bytes]:
    return [b.path.read_bytes() for b in got.layers]


def kept_nothing_of_evil(store: BlobStore) -> bool:
    leftovers = not store.tmp_dir.exists() or not any(store.tmp_dir.iterdir())
    return leftovers and not store.has(EVIL_LAYER.digest) and not store.has(EVIL_LAYER.diff_id)


Importer = Callable[[oi.Image, BlobStore, Path], FetchedImage]


def from_registry(registry: RegistryServer) -> Importer:
    def run(img: oi.Image, store: BlobStore, _tmp: Path) -> FetchedImage:
        tag = "good" if img is GOOD else "evil"
        return fetch_image(
            f"{registry.address}/poison/app:{tag}",
            store,
            policy=registry.policy(),
            credentials_for=NO_CREDENTIALS,
        )

    return run


def from_layout(img: oi.Image, store: BlobStore, tmp: Path) -> FetchedImage:
    layout = oi.write_oci_layout(tmp / f"layout-{id(img)}", {"1": img})
    return fetch_image(f"oci:{layout}:1", store, policy=RegistryPolicy())


def from_oci_archive(img: oi.Image, store: BlobStore, tmp: Path) -> FetchedImage:
    archive = oi.write_oci_archive(tmp / f"oci-{id(img)}.tar", {"1": img})
    return fetch_image(f"oci-archive:{archive}:1", store, policy=RegistryPolicy())


def from_docker_archive(img: oi.Image, store: BlobStore, tmp: Path) -> FetchedImage:
    archive = oi.write_docker_archive(tmp / f"docker-{id(img)}.tar", {"app:1": img})
    return fetch_image(f"docker-archive:{archive}", store, policy=RegistryPolicy())


def from_loaded_docker_save(img: oi.Image, store: BlobStore, tmp: Path) -> FetchedImage:
    archive = oi.write_docker_archive(tmp / f"load-{id(img)}.tar", {"app:1": img}, oci_blobs=True)
    return fetch_loaded(archive, "app:1", store, lambda _m: None, shown="loaded:app:1")


def from_loaded_oci_archive(img: oi.Image, store: BlobStore, tmp: Path) -> FetchedImage:
    archive = oi.write_oci_archive(tmp / f"load-oci-{id(img)}.tar", {"app:1": img})
    return fetch_loaded(archive, "app:1", store, lambda _m: None, shown="loaded:app:1")


LOCAL: dict[str, Importer] = {
    "oci": from_layout,
    "oci-archive": from_oci_archive,
    "docker-archive": from_docker_archive,
    "load docker save": from_loaded_docker_save,
    "load oci archive": from_loaded_oci_archive,
}


DOCKER_SAVES = ("docker-archive", "load docker save")


def importers(registry: RegistryServer) -> dict[str, Importer]:
    return {"registry": from_registry(registry), **LOCAL}


@pytest.mark.parametrize("source", ["registry", *LOCAL])
@pytest.mark.parametrize("evil_first", [True, False], ids=["evil-first", "good-first"])
def test_an_image_with_another_images_config_and_other_layers_is_refused(
    source: str, evil_first: bool, registry: RegistryServer, store: BlobStore, tmp_path: Path
) -> None:
    run = importers(registry)[source]
    if not evil_first:
        assert contents(run(GOOD, store, tmp_path)) == contents_of(GOOD, source)
    try:
        got = run(EVIL, store, tmp_path)
    except Invalid as refused:
        assert isinstance(refused, LayerMismatch), refused
        assert "layer 1" in str(refused) and GOOD_LAYER.diff_id in str(refused)
    else:
        # A docker save archive names its layers by their diff_ids alone: with the real
        # layer held (and checked) already, the config's own layers are what it gets.
        assert source in DOCKER_SAVES and not evil_first
        assert contents(got) == contents_of(GOOD, source)
    assert kept_nothing_of_evil(store)
    good = run(GOOD, store, tmp_path)
    assert contents(good) == contents_of(GOOD, source)
    assert [b.diff_id for b in good.layers] == [GOOD_LAYER.diff_id]


def contents_of(img: oi.Image, source: str) -> list[bytes]:
    """What the store holds of ``img``'s layers after an import from ``source``: a
    ``docker save`` archive holds the uncompressed tars."""
    if source in DOCKER_SAVES:
        return [lay.tar for lay in img.layers]
    return [lay.data for lay in img.layers]


def test_a_held_layer_blob_is_checked_against_the_config_that_names_it(
    registry: RegistryServer, store: BlobStore
) -> None:
    # The attacker's honest image puts the evil blob into the cache first...
    own = fetch_image(
        f"{registry.address}/poison/own:1",
        store,
        policy=registry.policy(),
        credentials_for=NO_CREDENTIALS,
    )
    assert store.has(EVIL_LAYER.digest)
    # ...so the poisoned image's layer is not fetched: the held blob is checked instead.
    with pytest.raises(LayerMismatch):
        fetch_image(
            f"{registry.address}/poison/app:evil",
            store,
            policy=registry.policy(),
            credentials_for=NO_CREDENTIALS,
        )
    assert store.has(EVIL_LAYER.digest)  # still the honest image's, whole
    assert store.is_verified(EVIL_LAYER.digest, EVIL_LAYER.diff_id)
    assert not store.is_verified(EVIL_LAYER.digest, GOOD_LAYER.diff_id)
    assert own.layers[0].diff_id == EVIL_LAYER.diff_id


def test_a_held_plain_tar_a_docker_archive_would_reuse_is_checked_too(
    store: BlobStore, tmp_path: Path
) -> None:
    # A plain layer is held under its own digest; a docker save archive whose config
    # names that digest as a diff_id reuses it only once it is checked.
    plain = oi.layer({"etc/": oi.Dir(), "etc/marker": b"plain\n"}, "none")
    assert plain.digest == plain.diff_id
    from_layout(oi.image([plain]), store, tmp_path)
    (store.diff_ids_dir / plain.digest[7:]).unlink()  # as a cache from before the records
    again = from_docker_archive(oi.image([plain], {"Cmd": ["y"]}), store, tmp_path)
    assert again.bytes_fetched < len(plain.tar) and store.is_verified(plain.digest, plain.diff_id)


def test_a_reference_pinned_by_digest_gives_that_manifests_layers(
    registry: RegistryServer, store: BlobStore
) -> None:
    pinned = f"{registry.address}/poison/app@{GOOD.manifest.digest}"
    got = fetch_image(pinned, store, policy=registry.policy(), credentials_for=NO_CREDENTIALS)
    assert got.manifest_digest == GOOD.manifest.digest
    assert contents(got) == [GOOD_LAYER.data]
    with pytest.raises(Invalid):  # the evil manifest by its digest: refused, not the good
        fetch_image(
            f"{registry.address}/poison/app@{EVIL.manifest.digest}",
            store,
            policy=registry.policy(),
            credentials_for=NO_CREDENTIALS,
        )


def test_a_layer_that_inflates_past_the_cap_is_refused_while_it_streams(
    store: BlobStore, tmp_path: Path
) -> None:
    big = oi.layer({"zeros": b"\0" * (4 << 20)})
    img = oi.image([big])
    layout = oi.write_oci_layout(tmp_path / "big", {"1": img})
    with pytest.raises(Invalid, match="decompresses to more than 1048576 bytes"):
        fetch_image(f"oci:{layout}:1", store, policy=RegistryPolicy(), layer_cap=1 << 20)
    assert not store.has(big.digest)
    assert fetch_image(f"oci:{layout}:1", store, policy=RegistryPolicy()).layers[0].diff_id


# ---------------------------------------------------------------------- the build's key


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path))
    stand_in_boot_parts(monkeypatch, tmp_path)
    return tmp_path


def fetched(layers: list[oi.Layer], tmp: Path) -> FetchedImage:
    blobs = tuple(
        LayerBlob(lay.digest, lay.size, lay.media_type, tmp / lay.digest[7:], lay.diff_id)
        for lay in layers
    )
    return FetchedImage(
        "reg.test/app:1", "sha256:" + "1" * 64, GOOD.config.digest, ImageConfig(), blobs, 0, 0
    )


def test_a_build_is_found_again_only_when_config_and_every_layer_match(cache: Path) -> None:
    made: list[str] = []

    def build(layers: list[oi.Layer]) -> Any:
        img = fetched(layers, cache)

        def write(out: Path, _work: Path) -> RootfsStats:
            made.append(img.layers[0].digest)
            out.write_bytes(b"squashfs")
            return RootfsStats(layers=1, entries=1, file_bytes=8, image_bytes=8)

        identity = {
            "reference": img.reference,
            "layers": [b.digest for b in img.layers],
            "diff_ids": [b.diff_id for b in img.layers],
        }
        return container_image.assemble(img.config_digest, img.config, identity, write)

    good = build([GOOD_LAYER])
    evil = build([EVIL_LAYER])  # the same config digest: the same name, another key
    assert good.name == evil.name and good.dir != evil.dir
    assert build([GOOD_LAYER]).dir == good.dir
    assert made == [GOOD_LAYER.digest, EVIL_LAYER.digest]


def test_a_layer_is_merged_as_it_was_checked_even_with_a_zstd_frame_cut_short(
    tmp_path: Path,
) -> None:
    """A zstd layer whose last frame lost its checksum: the check read it whole (its tar
    matched the diff_id) while the merge, reading in small pieces, stopped early and lost
    the layer's last entry, a whiteout: the built image kept what the diff_id deletes."""
    base = oi.tar_of({"etc/": oi.Dir(), "etc/backdoor": b"#!/bin/sh\n"})
    top = oi.tar_of({"etc/motd": b"hi\n", "big": b"A" * 1024, "etc/.wh.backdoor": b""})
    cut = 4 * 512
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    blob = compress(top[:cut]) + compress(top[cut:])[:-4]
    diff_id = oi.digest_of(top)
    copy_checking_diff_id(iter([blob]), lambda _piece: None, diff_id, "layer 2", cap=1 << 30)
    paths_ = [tmp_path / "base", tmp_path / "top"]
    paths_[0].write_bytes(base)
    paths_[1].write_bytes(blob)
    layers = [
        LayerBlob(oi.digest_of(base), len(base), "x", paths_[0], oi.digest_of(base)),
        LayerBlob(oi.digest_of(blob), len(blob), "x", paths_[1], diff_id),
    ]
    tree = read_layers(layers, tmp_path, IMAGE_LIMITS)
    assert sorted(tree.root.children["etc"].children) == ["motd"]


def test_a_layer_that_merges_to_another_tar_than_its_diff_id_is_refused(tmp_path: Path) -> None:
    """Should the blob on disk ever differ from what was checked, the merge refuses it."""
    tar = oi.tar_of({"a": b"a"})
    blob = tmp_path / "blob"
    blob.write_bytes(tar)
    layer = LayerBlob(oi.digest_of(tar), len(tar), "x", blob, GOOD_LAYER.diff_id)
    with pytest.raises(BadArchive, match="not " + GOOD_LAYER.diff_id):
        read_layers([layer], tmp_path, IMAGE_LIMITS)


def test_an_image_pulled_with_a_snapshot_never_stands_for_an_imported_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pulled snapshot's image record is what a registry said: its references, digests
    and build time are its own words, so it may not answer for ``python:3.12`` or for the
    image id it claims."""
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path))
    from forkd.controller.services import image_catalog
    from forkd.guest import pulled_image
    from forkd.oci import image_files

    rootfs = b"the registry's root" * 10
    files = {"rootfs.sqfs": [(0, len(rootfs), oi.digest_of(rootfs))]}
    claimed = "sha256:" + "ab" * 32
    meta = pulled_image.checked(
        {
            "kind": "container",
            "manifest_digest": "sha256:" + "cd" * 32,
            "config_digest": claimed,
            "layers": [GOOD_LAYER.digest],
            "references": ["loaded:python:3.12", "registry.test/python:3.12"],
            "built_at_unix": 2**52,
            "config": {},
        }
    )
    config = {"image": {"name": container_image.image_name(claimed), "key": "0123456789abcdef"}}
    image_files.install(paths.images_dir(), config, files, lambda _d, _n: rootfs, meta)
    assert image_catalog.local("python:3.12") is None
    assert image_catalog.newest_import(container_image.image_name(claimed)) is None
