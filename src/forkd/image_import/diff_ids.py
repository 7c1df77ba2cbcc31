"""A layer checked against its ``diff_id`` as it streams: the digest of the tar it holds,
not of the blob as stored.

A registry, an OCI layout and a ``docker save`` archive name a layer by the digest
of its blob (gzip, zstd or plain), which the blob store checks; the image's config
names it by the digest of the tar inside (``rootfs.diff_ids``). Only the second
ties the layers to the config: without it, two images whose configs are the same
bytes (the same image id) could hold different files. So every layer an import
reads is decompressed as it arrives, its tar hashed and compared with the config's
diff_id before the blob is kept (:func:`copy_checking_diff_id`), and a blob the
store held already is checked the same way once, then remembered as checked
(:meth:`~forkd.image_import.blob_store.BlobStore.mark_verified`).

A layer is decompressed by what its first bytes say, as
:func:`forkd.image_import.layers.open_layer` reads it when the layers are merged:
gzip (every member), zstd (every frame, within a bounded window) or a plain tar;
xz and bzip2 are refused. More than ``cap`` decompressed bytes is refused while it
is read: a small blob that inflates without end costs no more than ``cap``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Protocol, cast

import zstandard

from forkd import import_deadline
from forkd.errors import Invalid

PIECE = 1 << 20  # decompressed bytes hashed at a time
ZSTD_MAX_WINDOW = 1 << 27  # zstd's default limit: a frame asking for more memory is refused
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
REFUSED_MAGIC = {b"\xfd7zXZ": "xz", b"BZh": "bzip2"}
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class LayerMismatch(Invalid):
    """A layer's tar is not what the image's config says it is (its diff_id)."""


class Readable(Protocol):
    def read(self, n: int = ..., /) -> bytes: ...


def compression_of(head: bytes) -> str:
    """``gzip``, ``zstd`` or ``none`` for a blob starting with ``head`` (6 bytes or
    more); :class:`Invalid` for a compression forkd does not read."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    for prefix, name in REFUSED_MAGIC.items():
        if head.startswith(prefix):
            raise Invalid(f"the layer is compressed with {name}, not gzip or zstd")
    return "none"


def decompressing(raw: Readable, compression: str) -> Readable:
    """A reader of what ``raw`` holds, decompressed as ``compression`` says."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=cast(IO[bytes], raw), mode="rb")
    if compression == "zstd":
        # zstandard's stub asks for IO[bytes]; it reads any object with read(size).
        decompressor = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        return decompressor.stream_reader(cast(IO[bytes], raw), read_across_frames=True)
    return raw


def media_type_of(compression: str) -> str:
    return OCI_LAYER if compression == "none" else f"{OCI_LAYER}+{compression}"


class _Tee:
    """A file-like reader of chunks that hands every byte read to ``write`` as well."""

    def __init__(self, chunks: Iterator[bytes], write: Callable[[bytes], None]) -> None:
        self._chunks, self._write = chunks, write
        self._buffer = b""

    def peek(self, n: int) -> bytes:
        while len(self._buffer) < n:
            piece = next(self._chunks, b"")
            if not piece:
                break
            self._buffer += piece
        return self._buffer[:n]

    def read(self, n: int = -1) -> bytes:
        if not self._buffer:
            self._buffer = next(self._chunks, b"")
        n = len(self._buffer) if n is None or n < 0 else n
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        if piece:
            self._write(piece)
        return piece

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        """A stream: not seekable (GzipFile only seeks to rewind, which nothing here asks)."""
        raise io.UnsupportedOperation("seek")

    def drain(self) -> None:
        while self.read(PIECE):
            pass


def copy_checking_diff_id(
    chunks: Iterator[bytes],
    write: Callable[[bytes], None],
    diff_id: str,
    what: str,
    *,
    cap: int,
) -> str:
    """Copy a layer's blob, piece by piece as ``chunks`` gives it, to ``write``, hashing
    the tar it holds; its media type (by its compression). :class:`LayerMismatch`
    naming ``what`` when that tar is not ``diff_id``; :class:`Invalid` when it does
    not decompress or inflates past ``cap`` bytes. Every byte of the blob has gone to
    ``write`` when this returns or raises either (but past ``cap``)."""
    tee = _Tee(chunks, write)
    compression = compression_of(tee.peek(6))
    stream = decompressing(tee, compression)
    h, total = hashlib.sha256(), 0
    try:
        while piece := stream.read(PIECE):
            total += len(piece)
            if total > cap:
                raise Invalid(f"{what} decompresses to more than {cap} bytes: refused")
            h.update(piece)
        tee.drain()  # what follows the end the decompressor saw is the blob's too
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
        tee.drain()  # the whole blob read: the caller may find it is not its digest
        raise Invalid(f"{what} is not a valid {compression} stream ({exc})") from None
    got = "sha256:" + h.hexdigest()
    if got != diff_id:
        raise LayerMismatch(
            f"{what} holds the tar {got}, not {diff_id} as the image's config says "
            "(rootfs.diff_ids): refused"
        )
    return media_type_of(compression)


def file_chunks(path: Path, piece: int = PIECE) -> Iterator[bytes]:
    """A file's bytes in pieces (a blob the store holds, checked again)."""
    with open(path, "rb") as f:
        while data := f.read(piece):
            import_deadline.check()
            yield data
