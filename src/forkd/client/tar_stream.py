"""Local directories as tar streams, both ways, in bounded memory.

:func:`tar_chunks` packs a directory as the daemon's ``format=tar`` upload
expects (members ``./...``), writing from a thread into a pipe so only a
pipe's worth is held at once. :func:`extract_chunks` unpacks a download with
the standard library's ``data`` filter: no absolute names, no ``..``, no
links out of the directory, no devices.
"""

from __future__ import annotations

import os
import tarfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

CHUNK_BYTES = 1 << 20


def tar_chunks(directory: Path) -> Iterator[bytes]:
    """The content of ``directory`` as a tar stream, in chunks of at most CHUNK_BYTES."""
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")
    read_fd, write_fd = os.pipe()
    failure: list[BaseException] = []

    def pack() -> None:
        try:
            with os.fdopen(write_fd, "wb") as pipe, tarfile.open(fileobj=pipe, mode="w|") as tar:
                tar.add(directory, arcname=".", recursive=True)
        except BaseException as exc:  # a broken pipe too: the reader stopped
            failure.append(exc)

    packer = threading.Thread(target=pack, name="forkd-tar", daemon=True)
    packer.start()
    try:
        with os.fdopen(read_fd, "rb") as pipe:
            while chunk := pipe.read(CHUNK_BYTES):
                yield chunk
    finally:
        packer.join()
    if failure:
        raise failure[0]


class _ChunkReader:
    """A read()-able file over an iterator of byte chunks."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buf += chunk
        if size < 0:
            size = len(self._buf)
        data, self._buf = self._buf[:size], self._buf[size:]
        return data


def extract_chunks(chunks: Iterable[bytes], directory: Path) -> None:
    """Unpack a tar stream into ``directory`` (created if missing), refusing members
    that would land outside it."""
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:  # type: ignore[call-overload]
        tar.extractall(directory, filter="data")
