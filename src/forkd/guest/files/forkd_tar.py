"""Tar streams of the forkd guest agent: a directory written as one, and one extracted
safely into a directory.

Imported by forkd_files.py, whose tar transfers run these on a thread at the
other end of a pipe. Standard library only, like the agent. Extraction is
forkd's one extractor (the ``forkd.archive`` package, which the image places
beside the agent): it never writes outside its directory.
"""

from __future__ import annotations

import os
import tarfile
from typing import BinaryIO

from forkd.archive import DATA, ArchiveTooLarge, BadArchive, Limits, UnsafeEntry, extract

# The names the agent's answers have carried ("kind"), kept for its callers.
BadArchiveError = BadArchive
UnsafeArchiveError = UnsafeEntry
__all__ = [
    "ArchiveTooLarge",
    "BadArchiveError",
    "UnsafeArchiveError",
    "extract_tar",
    "write_all",
    "write_paths_tar",
    "write_tar",
]


def write_all(fd: int, data: bytes | bytearray) -> None:
    """All of ``data`` to ``fd``, however many writes it takes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_tar(pipe: BinaryIO, path: str) -> None:
    """The directory ``path`` as a tar stream of its content (members "./..."); links
    are stored as links, never followed."""
    with tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.add(path, arcname=".", recursive=True)


def write_paths_tar(pipe: BinaryIO, paths: list[str]) -> None:
    """The files at ``paths`` as a tar stream, each named by its path without the
    leading slash; a directory as its own entry only; links stored, never followed;
    a path gone meanwhile left out."""
    with tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            try:
                tar.add(path, arcname=path.lstrip("/") or ".", recursive=False)
            except FileNotFoundError:
                continue


# --------------------------------------------------------------------------- safe extraction

# An upload is bounded by the guest's own disk, not by the archive's counts.
UPLOAD_LIMITS = Limits(max_entries=10_000_000, max_bytes=1 << 50)


def extract_tar(pipe: BinaryIO, dest: str) -> None:
    """Extract the tar stream on ``pipe`` into ``dest`` with forkd's one extractor
    (forkd/archive, shipped beside the agent): nothing lands, points or links
    outside ``dest``; devices are refused."""
    extract(pipe.read, dest, DATA, UPLOAD_LIMITS)
