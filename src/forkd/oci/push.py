"""Push one snapshot: its image, device state and memory as pieces, then its manifest.

Blobs go first and the manifest last, so a push that fails half way leaves
no manifest: only blobs the registry's garbage collection reclaims. Each
piece is hashed before it is sent and sent only when the registry lacks it,
so an image goes up once per repository and a branch pushed after its parent
sends what changed: either the chunks that differ (``chunks``), or, when the
parent is in the repository, the pages that differ from it (``delta``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from forkd.oci import artifact, image_files, volume_files
from forkd.oci.artifact import Layer, Manifest
from forkd.oci.registry import sha256
from forkd.oci.repository import PushTarget
from forkd.vmm.snapshot import memory, memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles
from forkd.vmm.snapshot.memory_diff import Chain

PAGE = memory.PAGE
ZSTD_LEVEL = 3  # fixed: the same content must give the same blob, push after push
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Base:
    """The manifest a delta is taken over, and its memory on this host."""

    digest: str
    tag: str | None
    chain: Chain
    # Pages outside these runs are known equal to the base (a diff over it): not compared.
    candidates: list[tuple[int, int]] | None = None


@dataclass
class Pushed:
    digest: str
    encoding: str
    base_digest: str | None
    bytes_uploaded: int = 0
    bytes_total: int = 0
    layers: int = 0
    layers_uploaded: int = 0
    memory_pages: int = 0  # pages sent in the delta, or in non-zero chunks
    seconds: float = 0.0


@dataclass
class _Uploader:
    registry: PushTarget
    result: Pushed
    layers: list[Layer] = field(default_factory=list)
    compressor: zstandard.ZstdCompressor = field(
        default_factory=lambda: zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    )

    def blob(self, data: bytes, digest: str | None = None) -> tuple[str, int]:
        digest = digest or sha256(data)
        if not self.registry.has_blob(digest):
            self.registry.put_blob(data, digest)
            self.result.bytes_uploaded += len(data)
            self.result.layers_uploaded += 1
        self.result.bytes_total += len(data)
        return digest, len(data)

    def layer(self, kind: str, raw: bytes, part: str, offset: int) -> None:
        data = self.compressor.compress(raw) if kind in artifact.COMPRESSED_TYPES else raw
        digest, size = self.blob(data)
        self.layers.append(Layer(kind, digest, size, part, offset, len(raw)))


def push(
    files: SnapshotFiles,
    image_dir: Path,
    config: dict[str, Any],
    registry: PushTarget,
    reference: str | None,
    base: Base | None,
    progress: Progress,
    volumes: tuple[Path, ...] = (),
) -> Pushed:
    """Push ``files`` (its memory a delta over ``base`` when given) as ``reference``, a tag
    (``None``: by digest only), with the image files in ``image_dir`` that ``config``
    names. ``config`` is completed here with the memory's encoding.
    ``volumes``: each attached volume's disk as a raw file (:mod:`.volume_files`)."""
    started = time.monotonic()
    result = Pushed("", "delta" if base else "chunks", base.digest if base else None)
    up = _Uploader(registry, result)
    progress("image files")
    _image(up, image_dir, artifact.image_file_names(config))
    progress("device state")
    up.layer(artifact.VMSTATE_TYPE, files.vmstate.read_bytes(), "vmstate", 0)
    for index, disk in enumerate(volumes):
        progress(f"volume {index}")
        for offset, data in volume_files.chunks(disk):
            up.layer(artifact.VOLUME_TYPE, data, volume_files.part(index), offset)
    with memory_diff.resolve(files) as chain:
        progress(f"memory ({result.encoding})")
        if base is not None:
            mark = len(up.layers)
            try:
                _delta(up, chain, base)
            except _TooScattered:  # an index no puller would take: the whole memory
                del up.layers[mark:]
                base, result.encoding, result.base_digest = None, "chunks", None
        if base is None:
            _chunks(up, chain)
    config["memory"] = {
        "bytes": files.meta.memory_bytes,
        "encoding": result.encoding,
        "chunk_bytes": artifact.MEMORY_CHUNK,
        "pages": result.memory_pages,
        "base": {"digest": base.digest, "tag": base.tag} if base else None,
    }
    cdigest, csize = up.blob(artifact.config_bytes(config))
    # The snapshot's own time: pushing it again gives the same manifest, the same digest.
    taken = time.gmtime(files.meta.created_at_unix)
    notes = {"org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", taken)}
    body = Manifest(cdigest, csize, tuple(up.layers), notes).to_bytes()
    progress("manifest")
    result.digest = registry.put_manifest(body, reference or sha256(body))
    result.bytes_uploaded += len(body)
    result.bytes_total += len(body)
    result.layers = len(up.layers)
    result.seconds = round(time.monotonic() - started, 3)
    return result


def _image(up: _Uploader, image_dir: Path, names: tuple[str, ...]) -> None:
    for name in names:
        path = image_dir / name
        for offset, length, digest in image_files.pieces(path):
            if up.registry.has_blob(digest):
                up.result.bytes_total += length
            else:
                up.blob(image_files.read_piece(path, offset, length), digest)
            up.layers.append(Layer(artifact.IMAGE_FILE_TYPE, digest, length, name, offset, length))


def _chunks(up: _Uploader, chain: Chain) -> None:
    """Guest RAM in chunks; all-zero chunks (holes, mostly) are left out."""
    step = artifact.MEMORY_CHUNK // PAGE
    npages = chain.size // PAGE
    for first in range(0, npages, step):
        end = min(first + step, npages)
        data = chain.read(first, end)
        if data.count(0) == len(data):
            continue
        up.result.memory_pages += end - first
        up.layer(artifact.CHUNK_TYPE, data, "memory", first * PAGE)


def _delta(up: _Uploader, chain: Chain, base: Base) -> None:
    """The pages that differ from ``base``: an index of runs and the pages packed in order."""
    if base.chain.size != chain.size:
        raise ValueError("a delta needs a base of the same memory size")
    runs: list[tuple[int, int]] = []
    packed = bytearray()
    sent = 0  # bytes of the packed stream already uploaded
    step = memory_diff.CHUNK_PAGES
    for lo, hi in base.candidates or [(0, chain.size // PAGE)]:
        for first in range(lo, hi, step):
            end = min(first + step, hi)
            new, old = chain.read(first, end), base.chain.read(first, end)
            for at, pages in memory_diff.differing(first, new, old):
                stop = at + len(pages) // PAGE
                if runs and runs[-1][1] == at:  # a run going on from the previous chunk
                    runs[-1] = (runs[-1][0], stop)
                else:
                    runs.append((at, stop))
                packed += pages
            while len(packed) >= artifact.PAGES_PIECE:
                up.layer(artifact.PAGES_TYPE, bytes(packed[: artifact.PAGES_PIECE]), "pages", sent)
                del packed[: artifact.PAGES_PIECE]
                sent += artifact.PAGES_PIECE
    if packed:
        up.layer(artifact.PAGES_TYPE, bytes(packed), "pages", sent)
    index = memory_diff.runs_bytes(runs)
    if len(index) > artifact.MAX_PIECE:
        raise _TooScattered
    up.result.memory_pages = sum(end - first for first, end in runs)
    up.layer(artifact.RUNS_TYPE, index, "runs", 0)


class _TooScattered(Exception):
    """A delta's index of runs would be over the largest piece a pull accepts."""
