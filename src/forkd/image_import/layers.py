"""An image's layers read, checked and merged into one tree in memory (:func:`read_layers`).

Each layer is read once, as a stream, through :class:`forkd.archive.tar_format.TarReader`
while it is decompressed (gzip, zstd or none, told apart by magic bytes). Nothing of
it is unpacked onto the host: the tree holds names and metadata, and a regular
file's content is copied into one data file per layer in the caller's scratch
directory, where :mod:`forkd.image_import.squash` reads it back by offset. Runs of
zeros a whole chunk long are not copied but kept as holes, so a sparse or a
zero-filled file costs no scratch disk.

The layers are merged by Docker's rules, which :mod:`forkd.image_import.tree`
states and applies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import zstandard

from forkd.archive.errors import ArchiveError, ArchiveTooLarge, BadArchive
from forkd.archive.tar_format import Limits, TarReader, max_stream
from forkd.errors import Invalid
from forkd.image_import import diff_ids
from forkd.image_import.diff_ids import Readable
from forkd.image_import.model import LayerBlob
from forkd.image_import.tree import Tree
from forkd.limits import MAX_IMAGE_BYTES, MAX_IMAGE_ENTRIES

IMAGE_LIMITS = Limits(
    max_entries=MAX_IMAGE_ENTRIES,  # per layer, and in the merged tree
    max_bytes=MAX_IMAGE_BYTES,  # apparent bytes per layer and merged; stored bytes of all layers
    max_header_bytes=1 << 20,
    max_path_bytes=4096,
    max_depth=256,
)


def image_limits(max_bytes: int | None = None, max_entries: int | None = None) -> Limits:
    """:data:`IMAGE_LIMITS` with the operator's ``--max-image-mib`` and
    ``--max-image-entries`` (None: the default)."""
    return dataclasses.replace(
        IMAGE_LIMITS,
        max_bytes=max_bytes or IMAGE_LIMITS.max_bytes,
        max_entries=max_entries or IMAGE_LIMITS.max_entries,
    )


def layer_cap(max_bytes: int, max_entries: int | None = None) -> int:
    """The most one layer's tar may be when an image may expand to ``max_bytes`` in at
    most ``max_entries``: what its diff_id is checked over while it is fetched."""
    return max_stream(image_limits(max_bytes, max_entries))


Progress = Callable[[str], None]


# ---------------------------------------------------------------------- reading layers


class LayerStream:
    """A layer's tar stream, decompressed by what its first bytes say (as its diff_id was
    checked), read from the decompressor in pieces of one size whatever the caller asks
    (a decompressor's answer must not depend on it), and hashed: :meth:`finish` reads
    what the tar reader left and says whether the whole is the layer's ``diff_id``.
    More than ``cap`` decompressed bytes is :class:`ArchiveTooLarge`."""

    def __init__(self, stream: Readable, cap: int) -> None:
        self._stream, self._cap = stream, cap
        self._buffer = memoryview(b"")
        self._hash = hashlib.sha256()
        self.total = 0

    def read(self, n: int) -> bytes:
        if not self._buffer:
            self._buffer = memoryview(self._pull())
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        return bytes(piece)

    def _pull(self) -> bytes:
        try:
            piece = self._stream.read(diff_ids.PIECE)
        except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as exc:
            raise BadArchive(f"the layer does not decompress: {exc}") from None
        self.total += len(piece)
        if self.total > self._cap:
            raise ArchiveTooLarge(f"the layer decompresses to more than {self._cap} bytes")
        self._hash.update(piece)
        return piece

    def finish(self, diff_id: str) -> None:
        """Read the rest; :class:`BadArchive` unless all of it was the tar ``diff_id``
        names ("" checks nothing)."""
        while self._pull():
            pass
        got = "sha256:" + self._hash.hexdigest()
        if diff_id and got != diff_id:
            raise BadArchive(f"the layer decompressed to the tar {got} when merged, not {diff_id}")


@runtime_checkable
class _Closable(Protocol):
    def close(self) -> None: ...


@contextlib.contextmanager
def open_layer(path: Path, cap: int) -> Iterator[LayerStream]:
    """The layer at ``path`` as a :class:`LayerStream`."""
    with open(path, "rb") as raw:
        try:
            compression = diff_ids.compression_of(raw.read(6))
        except Invalid as exc:
            raise BadArchive(str(exc)) from None
        raw.seek(0)
        stream = diff_ids.decompressing(raw, compression)
        try:
            yield LayerStream(stream, cap)
        finally:
            if stream is not raw and isinstance(stream, _Closable):
                stream.close()  # the decompressor; ``with`` closes the file


def read_layers(
    layers: Sequence[LayerBlob], work: Path, limits: Limits, progress: Progress | None = None
) -> Tree:
    """Merge ``layers`` (bottom first) into one tree; their content goes to data files in
    ``work``. Errors name the layer's digest and the entry."""
    tree = Tree(limits)
    for index, layer in enumerate(layers):
        if progress is not None:
            progress(f"layer {index + 1}/{len(layers)} {_short(layer.digest)} {_mib(layer.size)}")
        data_path = work / f"layer-{index}.data"
        tree.data_paths.append(data_path)
        try:
            with (
                open(data_path, "wb") as data,
                open_layer(layer.path, max_stream(limits)) as stream,
            ):
                reader = TarReader(stream.read, limits)
                for member in reader:
                    tree.apply(member, reader, index, data)
                stream.finish(layer.diff_id)  # what was merged is what was checked
        except ArchiveError as exc:
            raise type(exc)(f"layer {index + 1}/{len(layers)} ({layer.digest}): {exc}") from None
    return tree


def _short(digest: str) -> str:
    algorithm, _, hex_part = digest.partition(":")
    return f"{algorithm}:{hex_part[:12]}…" if hex_part else digest[:20]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"
