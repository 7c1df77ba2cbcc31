"""Pull one snapshot: read and check its manifest and config, then write it into a staging
directory the caller renames into place.

Nothing is written before :func:`open_remote` has read the manifest and the
config and the caller has checked them (:mod:`forkd.oci.host_needs`,
:func:`forkd.oci.image_files.differences`). Every blob is checked against its
digest and every piece against the places the manifest gives it. A delta's
base is found on this host when it was pushed or pulled here before
(``local_base``), else pulled too, manifest by manifest, to a bounded depth.
The snapshot lands as a full one: its memory is written whole.
"""

from __future__ import annotations

import collections
import io
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zstandard

from forkd import limits
from forkd.errors import SnapshotError, UpstreamError
from forkd.oci import artifact
from forkd.oci.artifact import Layer, Manifest
from forkd.oci.repository import PullSource
from forkd.vmm.snapshot import memory, memory_diff
from forkd.vmm.snapshot.memory_diff import Chain

PAGE = memory.PAGE
LocalBase = Callable[[str], Chain | None]
FETCH_AHEAD = 4  # blobs in flight at once in one pull


@dataclass(frozen=True)
class Remote:
    """A snapshot in a registry: its manifest (checked) and config (checked)."""

    where: str
    digest: str
    manifest: Manifest
    config: dict[str, Any]
    manifest_bytes: int

    @property
    def memory_bytes(self) -> int:
        return int(self.config["memory"]["bytes"])


def open_remote(registry: PullSource, reference: str) -> Remote:
    """Read and check the manifest ``reference`` names and its config; writes nothing."""
    where = f"{registry.ref.registry}/{registry.ref.repository}@{reference}"
    body, digest = registry.get_manifest(reference)
    manifest = artifact.parse_manifest(body, where)
    raw = registry.get_blob(manifest.config_digest, manifest.config_size)
    config = artifact.parse_config(raw, where)
    size = int(config["memory"]["bytes"])
    if size <= 0 or size % PAGE or size >> 20 > limits.MAX_MEMORY_MIB:
        raise UpstreamError(f"{where} claims {size} bytes of guest memory")
    return Remote(where, digest, manifest, config, len(body))


class Downloads:
    """Blob fetches, counted; every blob checked by its source's ``get_blob``."""

    def __init__(self, registry: PullSource) -> None:
        self.registry = registry
        self.bytes = 0
        self._lock = threading.Lock()

    def fetch(self, digest: str, size: int) -> bytes:
        data = self.registry.get_blob(digest, size)
        with self._lock:
            self.bytes += len(data)
        return data

    def pieces(self, layers: list[Layer]) -> Iterator[tuple[Layer, bytes]]:
        """Each layer's content, in order, with up to :data:`FETCH_AHEAD` fetched and
        inflated ahead on threads (the network and zstd overlap the writes)."""
        pool = ThreadPoolExecutor(FETCH_AHEAD, thread_name_prefix="forkd-fetch")
        ahead: collections.deque[Future[bytes]] = collections.deque()
        todo = iter(layers)
        try:
            for layer in itertools.islice(todo, FETCH_AHEAD):
                ahead.append(pool.submit(self.piece, layer))
            for layer in layers:
                data = ahead.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    ahead.append(pool.submit(self.piece, nxt))
                yield layer, data
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def piece(self, layer: Layer) -> bytes:
        """A layer's content, uncompressed and exactly as long as the manifest says."""
        data = self.fetch(layer.digest, layer.size)
        if layer.media_type not in artifact.COMPRESSED_TYPES:
            return data
        try:
            # A bounded read: a blob that inflates past its length is refused, not inflated.
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
            raw = reader.read(layer.length + 1)
        except zstandard.ZstdError as exc:
            raise UpstreamError(f"layer {layer.digest} does not decompress: {exc}") from exc
        if len(raw) != layer.length:
            raise UpstreamError(f"layer {layer.digest} is not {layer.length} bytes uncompressed")
        return raw


def write_vmstate(remote: Remote, downloads: Downloads, fd: int) -> int:
    layers = remote.manifest.of_part("vmstate")
    if len(layers) != 1 or layers[0].media_type != artifact.VMSTATE_TYPE:
        raise UpstreamError(f"{remote.where} does not carry exactly one device state")
    data = downloads.piece(layers[0])
    memory._pwrite_all(fd, data, 0)
    return len(data)


def write_memory(
    registry: PullSource, remote: Remote, downloads: Downloads, fd: int, local_base: LocalBase
) -> None:
    """Write ``remote``'s whole guest memory into ``fd`` (an empty file), holes as holes."""
    os.ftruncate(fd, remote.memory_bytes)
    _materialize(registry, remote, downloads, fd, local_base, 0)


def _materialize(
    registry: PullSource,
    remote: Remote,
    downloads: Downloads,
    fd: int,
    local_base: LocalBase,
    depth: int,
) -> None:
    memory_conf = remote.config["memory"]
    if memory_conf["encoding"] == "chunks":
        _write_chunks(remote, downloads, fd)
        return
    base_digest = memory_conf["base"]["digest"]
    if depth >= limits.MAX_DIFF_DEPTH:
        raise UpstreamError(f"{remote.where} is a delta chain deeper than {depth}")
    chain = local_base(base_digest)
    if chain is not None:
        with chain:
            if chain.size != remote.memory_bytes:
                raise UpstreamError(f"{remote.where}'s base on this host has another memory size")
            memory_diff.flatten(chain, fd)
    else:
        base = open_remote(registry, base_digest)
        if base.memory_bytes != remote.memory_bytes:
            raise UpstreamError(f"{remote.where}'s base {base_digest} has another memory size")
        _materialize(registry, base, downloads, fd, local_base, depth + 1)
    _write_delta(remote, downloads, fd)


def _write_chunks(remote: Remote, downloads: Downloads, fd: int) -> None:
    chunks = remote.manifest.of_part("memory")
    artifact.check_placed(
        chunks,
        artifact.CHUNK_TYPE,
        f"{remote.where}'s memory",
        limit=remote.memory_bytes,
        align=PAGE,
    )
    for layer, data in downloads.pieces(chunks):
        memory.write_nonzero(fd, data, layer.offset)


def _write_delta(remote: Remote, downloads: Downloads, fd: int) -> None:
    runs_layers = remote.manifest.of_part("runs")
    if len(runs_layers) != 1 or runs_layers[0].media_type != artifact.RUNS_TYPE:
        raise UpstreamError(f"{remote.where} is a delta without exactly one page index")
    try:
        runs = memory_diff.parse_runs(
            downloads.piece(runs_layers[0]), remote.memory_bytes // PAGE, remote.where
        )
    except SnapshotError as exc:
        raise UpstreamError(str(exc)) from exc
    pieces = remote.manifest.of_part("pages")
    want = sum(end - first for first, end in runs) * PAGE
    at = artifact.check_placed(
        pieces, artifact.PAGES_TYPE, f"{remote.where}'s pages", contiguous=True, align=PAGE
    )
    if at != want:
        raise UpstreamError(f"{remote.where} indexes {want} bytes of pages and carries {at}")
    targets = (p for first, end in runs for p in range(first, end))
    for _layer, raw in downloads.pieces(pieces):
        data = memoryview(raw)
        for p in range(0, len(data), PAGE):
            memory._pwrite_all(fd, data[p : p + PAGE], next(targets) * PAGE)
