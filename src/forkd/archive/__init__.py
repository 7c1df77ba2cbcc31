"""Untrusted tar archives, read and unpacked beneath one directory (standard library only).

The one extractor every archive forkd unpacks goes through: see
:mod:`forkd.archive.unpack` for how it stays beneath its target (its checks and
walks: :mod:`forkd.archive.beneath`) and :mod:`forkd.archive.tar_format` for what
it reads (each header's fields: :mod:`forkd.archive.tar_fields`).
"""

from forkd.archive.errors import ArchiveError, ArchiveTooLarge, BadArchive, UnsafeEntry
from forkd.archive.tar_format import Limits
from forkd.archive.unpack import DATA, ROOTFS, ChunkReader, Extracted, Policy, extract, extract_new

__all__ = [
    "DATA",
    "ROOTFS",
    "ArchiveError",
    "ArchiveTooLarge",
    "BadArchive",
    "ChunkReader",
    "Extracted",
    "Limits",
    "Policy",
    "UnsafeEntry",
    "extract",
    "extract_new",
]
