"""The images bench/images.py imports: a Debian tree and a few big files as OCI layers,
written to disk as they are made and pushed to a registry, the blobs streamed.

Not a benchmark itself. :func:`make_layers` writes the layers (each one's blob
digest and diff_id computed while it is written, nothing held in memory beyond
a chunk); :func:`push_image` pushes an image of some of them to a registry on
loopback over plain HTTP. Every image's config carries a label of the run, so
its digest (forkd's image id) is new each run: a first import is a first build.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import httpx
import zstandard

MIB = 1 << 20
CHUNK = 1 << 20
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPES = {"gzip": f"{OCI_LAYER}+gzip", "zstd": f"{OCI_LAYER}+zstd", "none": OCI_LAYER}
PUSH_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


class _Hashing:
    """A write-only stream that hashes and counts what passes through it."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()


@dataclass(frozen=True)
class Layer:
    path: Path  # the blob, as the registry serves it
    digest: str  # of the blob
    diff_id: str  # of the uncompressed tar
    size: int  # of the blob
    tar_bytes: int
    media_type: str

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


class LayerWriter:
    """One layer's tar, compressed and hashed as it is written."""

    def __init__(self, path: Path, compression: str) -> None:
        self.path, self.compression = path, compression
        self._file = path.open("wb")
        self._blob = _Hashing(self._file)
        self._compressor: Any
        if compression == "gzip":
            # Level 6, as docker and Go's gzip write by default.
            self._compressor = gzip.GzipFile(
                fileobj=self._blob, mode="wb", compresslevel=6, mtime=0
            )
        elif compression == "zstd":
            self._compressor = zstandard.ZstdCompressor(level=3).stream_writer(
                cast(IO[bytes], self._blob), closefd=False
            )
        else:
            self._compressor = self._blob
        self._tar_stream = _Hashing(self._compressor)
        self.tar = tarfile.open(  # noqa: SIM115  # closed by close()
            fileobj=cast(IO[bytes], self._tar_stream), mode="w|", format=tarfile.PAX_FORMAT
        )

    def add(
        self, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, mode: int = 0o644
    ) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, 1_700_000_000
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        self.tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    def copy_tar(self, source: Path) -> None:
        """Every entry of ``source`` (a tar this host made: trusted), as it is."""
        with tarfile.open(source, mode="r|") as src:
            for member in src:
                self.tar.addfile(member, src.extractfile(member) if member.isreg() else None)

    def close(self) -> Layer:
        self.tar.close()
        if self._compressor is not self._blob:
            self._compressor.close()
        self._file.close()
        return Layer(
            self.path,
            "sha256:" + self._blob.sha.hexdigest(),
            "sha256:" + self._tar_stream.sha.hexdigest(),
            self._blob.bytes,
            self._tar_stream.bytes,
            MEDIA_TYPES[self.compression],
        )


def _text(rng: random.Random, size: int) -> bytes:
    """Text-like bytes (compress about as source code and logs do)."""
    words = [rng.randbytes(rng.randint(2, 7)).hex().encode() for _ in range(3000)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choices(words, k=64)) + b"\n"
    return bytes(out[:size])


@dataclass(frozen=True)
class Layers:
    base: Layer  # a Debian tree with python3
    deps: Layer  # a big incompressible file and many small modules
    data: Layer  # a big text file (zstd)
    app: Layer  # the first image's own small top layer
    app2: Layer  # the second image's own top layer


def make_layers(root: Path, debian_tar: Path, big_mib: int, seed: int = 1) -> Layers:
    """The layers, written under ``root``: ``debian_tar`` as the base, ``big_mib`` MiB
    of files on top, shared by both images, and each image's own top layer."""
    rng = random.Random(seed)
    base = LayerWriter(root / "base.tar.gz", "gzip")
    base.copy_tar(debian_tar)

    deps = LayerWriter(root / "deps.tar.gz", "gzip")
    deps.add("opt/venv/lib", kind=tarfile.DIRTYPE, mode=0o755)
    deps.add("opt/venv/lib/weights.bin", rng.randbytes(big_mib // 2 * MIB))
    for i in range(400):
        deps.add(f"opt/venv/lib/mod{i}.py", _text(rng, rng.randint(2000, 20000)))

    data = LayerWriter(root / "data.tar.zst", "zstd")
    data.add("srv/data", kind=tarfile.DIRTYPE, mode=0o755)
    data.add("srv/data/corpus.txt", _text(rng, (big_mib - big_mib // 2) * MIB))

    app = LayerWriter(root / "app.tar.gz", "gzip")
    app.add("srv/app", kind=tarfile.DIRTYPE, mode=0o755)
    app.add("srv/app/index.html", b"served by the first image\n")
    for i in range(50):
        app.add(f"srv/app/m{i}.py", _text(rng, rng.randint(500, 4000)))

    app2 = LayerWriter(root / "app2.tar.gz", "gzip")
    app2.add("srv/app", kind=tarfile.DIRTYPE, mode=0o755)
    app2.add("srv/app/index.html", b"served by the second image\n")
    app2.add("srv/app/model-v2.bin", rng.randbytes(12 * MIB))
    for i in range(50):
        app2.add(f"srv/app/v2_{i}.py", _text(rng, rng.randint(500, 4000)))
    return Layers(*(w.close() for w in (base, deps, data, app, app2)))


def config_for(layers: list[Layer], run: str, port: int) -> bytes:
    """An OCI config serving ``/srv/app`` on ``port`` (python3's http.server)."""
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/srv/app",
            "Cmd": ["python3", "-m", "http.server", str(port), "--directory", "/srv/app"],
            "ExposedPorts": {f"{port}/tcp": {}},
            "Labels": {"forkd.bench.run": run},
        },
        "rootfs": {"type": "layers", "diff_ids": [lay.diff_id for lay in layers]},
    }
    return json.dumps(doc, sort_keys=True).encode()


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _push_blob(
    client: httpx.Client, base: str, digest: str, size: int, content: bytes | Iterator[bytes]
) -> None:
    if client.head(f"{base}/blobs/{digest}").status_code == 200:
        return  # the registry holds it (a layer both images share)
    started = client.post(f"{base}/blobs/uploads/")
    started.raise_for_status()
    location = httpx.URL(base).join(started.headers["Location"])
    done = client.put(
        location.copy_merge_params({"digest": digest}),
        content=content,
        headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
    )
    done.raise_for_status()


def push_image(address: str, repo: str, tag: str, layers: list[Layer], run: str, port: int) -> str:
    """Push an image of ``layers`` (bottom first) as ``repo:tag``; its reference."""
    config = config_for(layers, run, port)
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [lay.descriptor() for lay in layers],
    }
    base = f"http://{address}/v2/{repo}"
    with httpx.Client(timeout=PUSH_TIMEOUT) as client:
        for lay in layers:
            _push_blob(client, base, lay.digest, lay.size, _chunks(lay.path))
        _push_blob(client, base, config_digest, len(config), config)
        put = client.put(
            f"{base}/manifests/{tag}",
            content=json.dumps(manifest).encode(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        put.raise_for_status()
    return f"{address}/{repo}:{tag}"
