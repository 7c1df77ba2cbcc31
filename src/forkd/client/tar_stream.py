"""Local directories as tar streams, both ways, in bounded memory.

:func:`tar_chunks` packs a directory as the daemon's ``format=tar`` upload
expects (members ``./...``), writing from a thread into a pipe so only a
pipe's worth is held at once. :func:`extract_chunks` unpacks a download, which
a hostile guest may have crafted, with forkd's one extractor
(:mod:`forkd.archive`): no absolute names, no ``..``, nothing written through
a link, no links out of the directory, no devices.
"""

from __future__ import annotations

import os
import tarfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from forkd.archive import DATA, ChunkReader, Limits, extract, extract_new

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


# A directory copied out of a sandbox: the guest chooses what is in it.
DOWNLOAD_LIMITS = Limits(max_entries=1_000_000, max_bytes=1 << 40)


def extract_chunks(chunks: Iterable[bytes], directory: Path) -> None:
    """Unpack a tar stream that a sandbox sent into ``directory`` with forkd's one
    extractor: nothing lands, points or links outside it (:mod:`forkd.archive`).

    A directory that does not exist yet is made whole or not at all (staged beside
    it, renamed into place); one that exists is unpacked into, keeping what it held,
    and an archive refused half-way leaves what it had written.
    """
    read = ChunkReader(chunks).read
    if directory.is_dir():
        extract(read, directory, DATA, DOWNLOAD_LIMITS)
    else:
        directory.parent.mkdir(parents=True, exist_ok=True)
        extract_new(read, directory, DATA, DOWNLOAD_LIMITS)
