"""Container images made in Python for tests: layer tars from a dict of files, an image
(config, manifest, optionally an index of several platforms), pushed to a registry with
plain HTTP requests or written as an OCI layout, an OCI archive or a ``docker save``
archive.

Everything is deterministic (times 0, owners as given): the same files make the same
digests, so two images built from one base share its layer."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class File:
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Symlink:
    target: str


@dataclass(frozen=True)
class Hardlink:
    target: str  # another entry's name in the same layer


Entry = bytes | File | Dir | Symlink | Hardlink


@dataclass(frozen=True)
class Blob:
    data: bytes
    media_type: str

    @property
    def digest(self) -> str:
        return digest_of(self.data)

    @property
    def size(self) -> int:
        return len(self.data)

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size, **extra}


@dataclass(frozen=True)
class Layer(Blob):
    tar: bytes = b""  # the layer uncompressed: its digest is the config's diff_id

    @property
    def diff_id(self) -> str:
        return digest_of(self.tar)


def tar_of(files: Mapping[str, Entry]) -> bytes:
    """A tar of ``files`` (name → content, in the dict's order), written by tarfile
    (this side is trusted)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, entry in files.items():
            info = tarfile.TarInfo(name)
            info.mtime = 0
            if isinstance(entry, bytes):
                entry = File(entry)
            if isinstance(entry, File):
                info.size, info.mode, info.uid, info.gid = (
                    len(entry.data),
                    entry.mode,
                    entry.uid,
                    entry.gid,
                )
                tar.addfile(info, io.BytesIO(entry.data))
                continue
            if isinstance(entry, Dir):
                info.type, info.mode, info.uid, info.gid = (
                    tarfile.DIRTYPE,
                    entry.mode,
                    entry.uid,
                    entry.gid,
                )
            elif isinstance(entry, Symlink):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
            else:
                info.type, info.linkname = tarfile.LNKTYPE, entry.target
            tar.addfile(info)
    return out.getvalue()


def layer(files: dict[str, Entry], compression: str = "gzip", *, docker: bool = False) -> Layer:
    """A layer of ``files``: ``gzip``, ``zstd`` or ``none``; ``docker`` gives Docker's
    media type (gzip only)."""
    tar = tar_of(files)
    if compression == "gzip":
        data = gzip.compress(tar, mtime=0)
        media_type = DOCKER_LAYER if docker else f"{OCI_LAYER}+gzip"
    elif compression == "zstd":
        data, media_type = zstandard.ZstdCompressor().compress(tar), f"{OCI_LAYER}+zstd"
    elif compression == "none":
        data, media_type = tar, OCI_LAYER
    else:
        raise ValueError(compression)
    return Layer(data, media_type, tar)


@dataclass(frozen=True)
class Image:
    config: Blob
    layers: tuple[Layer, ...]
    manifest: Blob

    def blobs(self) -> list[Blob]:
        return [self.config, *self.layers]


@dataclass(frozen=True)
class Index:
    manifest: Blob  # the index itself
    images: tuple[tuple[str, Image], ...] = field(default=())  # ("linux/amd64", image)


def image(
    layers: list[Layer],
    config: dict[str, Any] | None = None,
    *,
    platform: str = "linux/amd64",
    docker: bool = False,
    diff_ids: list[str] | None = None,
) -> Image:
    """An image of ``layers`` (bottom first) whose config's ``config`` is ``config``."""
    os_name, arch, *variant = platform.split("/")
    doc: dict[str, Any] = {
        "architecture": arch,
        "os": os_name,
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids or [lay.diff_id for lay in layers]},
    }
    if variant:
        doc["variant"] = variant[0]
    cfg = Blob(json.dumps(doc, sort_keys=True).encode(), DOCKER_CONFIG if docker else OCI_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
        "config": cfg.descriptor(),
        "layers": [lay.descriptor() for lay in layers],
    }
    body = json.dumps(manifest, sort_keys=True).encode()
    return Image(cfg, tuple(layers), Blob(body, DOCKER_MANIFEST if docker else OCI_MANIFEST))


def index(images: dict[str, Image], *, docker: bool = False) -> Index:
    """An index (a Docker manifest list with ``docker``) of one image per platform."""
    entries = []
    for platform, img in images.items():
        os_name, arch, *variant = platform.split("/")
        plat = {"os": os_name, "architecture": arch, **({"variant": variant[0]} if variant else {})}
        entries.append(img.manifest.descriptor(platform=plat))
    kind = DOCKER_LIST if docker else OCI_INDEX
    body = json.dumps({"schemaVersion": 2, "mediaType": kind, "manifests": entries}).encode()
    return Index(Blob(body, kind), tuple(images.items()))


# ---------------------------------------------------------------------- a registry


def push_blob(address: str, repo: str, blob: Blob, auth: tuple[str, str] | None = None) -> None:
    base = f"http://{address}/v2/{repo}"
    r = httpx.post(f"{base}/blobs/uploads/", auth=auth)
    assert r.status_code == 202, r.text
    location = httpx.URL(base).join(r.headers["Location"])
    r = httpx.put(
        location.copy_merge_params({"digest": blob.digest}),
        content=blob.data,
        headers={"Content-Type": "application/octet-stream"},
        auth=auth,
    )
    assert r.status_code == 201, r.text


def push_manifest(
    address: str, repo: str, reference: str, manifest: Blob, auth: tuple[str, str] | None = None
) -> None:
    r = httpx.put(
        f"http://{address}/v2/{repo}/manifests/{reference}",
        content=manifest.data,
        headers={"Content-Type": manifest.media_type},
        auth=auth,
    )
    assert r.status_code == 201, r.text


def push(
    address: str, repo: str, tag: str, what: Image | Index, auth: tuple[str, str] | None = None
) -> str:
    """Push an image or an index (its images by digest first) as ``repo:tag`` to the
    registry at ``address`` (plain HTTP); the digest of what ``tag`` names."""
    images = [img for _, img in what.images] if isinstance(what, Index) else [what]
    for img in images:
        for blob in img.blobs():
            push_blob(address, repo, blob, auth)
        if isinstance(what, Index):
            push_manifest(address, repo, img.manifest.digest, img.manifest, auth)
    push_manifest(address, repo, tag, what.manifest, auth)
    return what.manifest.digest


# ---------------------------------------------------------------------- files


def _layout_files(tagged: Mapping[str, Image | Index]) -> dict[str, bytes]:
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode()}
    entries = []
    for tag, what in tagged.items():
        images = [img for _, img in what.images] if isinstance(what, Index) else [what]
        for img in images:
            for blob in (*img.blobs(), img.manifest):
                files[f"blobs/sha256/{blob.digest[7:]}"] = blob.data
        files[f"blobs/sha256/{what.manifest.digest[7:]}"] = what.manifest.data
        entries.append(
            what.manifest.descriptor(annotations={"org.opencontainers.image.ref.name": tag})
        )
    files["index.json"] = json.dumps(
        {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
    ).encode()
    return files


def write_oci_layout(directory: Path, tagged: Mapping[str, Image | Index]) -> Path:
    """An OCI layout directory holding each image under its tag (``ref.name``)."""
    for name, data in _layout_files(tagged).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


def write_oci_archive(path: Path, tagged: Mapping[str, Image | Index]) -> Path:
    """A tar of an OCI layout (as ``skopeo copy ... oci-archive:`` writes)."""
    path.write_bytes(tar_of(_layout_files(tagged)))
    return path


def write_docker_archive(path: Path, tagged: dict[str, Image], *, oci_blobs: bool = False) -> Path:
    """``docker save`` output: ``manifest.json`` (Config, RepoTags, Layers) and the layers
    uncompressed, as ``<id>/layer.tar`` (Docker before 25) or ``blobs/sha256/<hex>``
    (``oci_blobs``, Docker 25 and later)."""
    files: dict[str, Entry] = {}
    entries = []
    for repo_tag, img in tagged.items():
        if oci_blobs:
            config_name = f"blobs/sha256/{img.config.digest[7:]}"
            names = [f"blobs/sha256/{lay.diff_id[7:]}" for lay in img.layers]
        else:
            config_name = f"{img.config.digest[7:]}.json"
            names = [f"{lay.diff_id[7:]}/layer.tar" for lay in img.layers]
        files[config_name] = img.config.data
        for name, lay in zip(names, img.layers, strict=True):
            files[name] = lay.tar
        entries.append({"Config": config_name, "RepoTags": [repo_tag], "Layers": names})
    files["manifest.json"] = json.dumps(entries).encode()
    path.write_bytes(tar_of(files))
    return path


def from_docker_save(path: Path) -> Image:
    """The image of a one-image ``docker save`` archive as an OCI image: its config's bytes
    as they are (so the image id stays the same), its layers uncompressed (each layer's
    digest is then its diff_id, as a ``docker-archive:`` import stores it)."""
    with tarfile.open(path) as tar:

        def member(name: str) -> bytes:
            f = tar.extractfile(name)
            assert f is not None, name
            return f.read()

        (entry,) = json.loads(member("manifest.json"))
        config = Blob(member(entry["Config"]), OCI_CONFIG)
        layers = tuple(Layer(t, OCI_LAYER, t) for t in map(member, entry["Layers"]))
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": config.descriptor(),
        "layers": [lay.descriptor() for lay in layers],
    }
    return Image(config, layers, Blob(json.dumps(manifest).encode(), OCI_MANIFEST))
