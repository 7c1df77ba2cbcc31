"""A root file system's tar stream read into a description two roots can be compared by:
each path's kind, mode, owner, size, link target, device, extended attributes, mtime
and content digest, and which names share an inode. Read with forkd.archive's
TarReader (not tarfile), so a ``docker export`` and an ``sqfs2tar`` of forkd's
squashfs go through the same parser."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from forkd.archive.tar_format import Kind, Limits, ReadFn, TarReader

CHUNK = 1 << 20
_ZEROS = bytes(CHUNK)
FIELDS = ("kind", "mode", "uid", "gid", "mtime", "size", "digest", "target", "device", "xattrs")


@dataclass(frozen=True)
class Entry:
    """One inode as a tar stream states it (a hard link's names share one)."""

    kind: Kind
    mode: int  # permission bits with setuid, setgid and sticky
    uid: int
    gid: int
    mtime: int
    size: int = 0  # a regular file's apparent size
    digest: str = ""  # of a regular file's content, holes read as zeros (_BlockDigest)
    target: str = ""  # a symlink's
    device: tuple[int, int] | None = None
    xattrs: tuple[tuple[str, bytes], ...] = ()


@dataclass
class RootTree:
    """Paths (no leading ``/`` or ``./``, no trailing ``/``; the root itself left out)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    # path -> the first name of its inode, for every name of an inode with several
    first_name: dict[str, str] = field(default_factory=dict)

    def link_groups(self) -> set[frozenset[str]]:
        """The names of each inode that has more than one."""
        groups: dict[str, set[str]] = {}
        for name, first in self.first_name.items():
            groups.setdefault(first, {first}).add(name)
        return {frozenset(names) for names in groups.values()}


def read_tree(read: ReadFn, limits: Limits) -> RootTree:
    """Every member of the tar stream ``read`` returns, described."""
    tree = RootTree()
    reader = TarReader(read, limits)
    for member in reader:
        path = _path(member.name)
        if not path:
            continue  # the root: Docker's export leaves it out
        if member.kind is Kind.HARDLINK:
            target = _path(member.linkname)
            first = tree.first_name.get(target, target)
            tree.entries[path] = tree.entries[first]
            tree.first_name[path] = tree.first_name[target] = first
            continue
        size, digest = 0, ""
        if member.kind is Kind.FILE:
            size, digest = member.size, _content_digest(reader, member.size)
        tree.entries[path] = Entry(
            kind=member.kind,
            mode=member.mode,
            uid=member.uid,
            gid=member.gid,
            mtime=member.mtime,
            size=size,
            digest=digest,
            target=member.linkname if member.kind is Kind.SYMLINK else "",
            device=(member.devmajor, member.devminor)
            if member.kind in (Kind.CHAR_DEVICE, Kind.BLOCK_DEVICE)
            else None,
            xattrs=tuple(sorted(member.xattrs.items())),
        )
    return tree


def _path(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts)


def _content_digest(reader: TarReader, size: int) -> str:
    digest = _BlockDigest()
    at = 0
    for offset, piece in reader.chunks(CHUNK):
        digest.zeros(offset - at)
        digest.data(piece)
        at = offset + len(piece)
    digest.zeros(size - at)
    return digest.hexdigest()


class _BlockDigest:
    """sha256 over a file's content in CHUNK-aligned blocks, a block of zeros hashed as a
    short marker: the same digest whether the zeros came as a hole or as bytes, and
    gigabytes of zeros cost a comparison, not a hash."""

    _ZERO_BLOCK = b"\0zero block\0"

    def __init__(self) -> None:
        self.hasher = hashlib.sha256()
        self.pending = bytearray()  # the start of a block not yet whole

    def zeros(self, count: int) -> None:
        if self.pending and count:
            step = min(count, CHUNK - len(self.pending))
            self.data(bytes(step))
            count -= step
        while count >= CHUNK:
            self.hasher.update(self._ZERO_BLOCK)
            count -= CHUNK
        if count:
            self.data(bytes(count))

    def data(self, piece: bytes) -> None:
        if not self.pending and len(piece) == CHUNK:
            self._block(piece)
            return
        self.pending += piece
        while len(self.pending) >= CHUNK:
            self._block(bytes(self.pending[:CHUNK]))
            del self.pending[:CHUNK]

    def _block(self, block: bytes) -> None:
        self.hasher.update(self._ZERO_BLOCK if block == _ZEROS else block)

    def hexdigest(self) -> str:
        if self.pending:
            self.hasher.update(self.pending)
        return self.hasher.hexdigest()


@dataclass(frozen=True)
class Difference:
    """One way two trees differ: ``what`` is a field's name, ``missing`` (the path is only
    in the expected tree), ``extra`` (only in the tree got) or ``hard links``."""

    path: str
    what: str
    expected: object = None
    got: object = None

    def __str__(self) -> str:
        if self.what in ("missing", "extra"):
            side = "expected" if self.what == "missing" else "got"
            return f"{self.path!r}: only in the tree {side} ({self.expected or self.got})"
        if self.what == "hard links":
            return f"hard links only in the tree {self.expected or self.got}: {self.path}"
        expected, got = self.expected, self.got
        if self.what == "mode":
            expected, got = oct(expected), oct(got)  # type: ignore[arg-type]
        return f"{self.path!r}: {self.what}: expected {expected!r}, got {got!r}"


def compare(
    expected: RootTree,
    got: RootTree,
    *,
    skip: frozenset[str] = frozenset(),
    skip_mtime: frozenset[str] = frozenset(),
) -> list[Difference]:
    """Where ``got`` differs from ``expected``: paths only one side has, fields that
    differ, hard link groups. Paths in ``skip`` are not compared at all, nor the mtimes
    of those in ``skip_mtime``."""
    out = []
    theirs, ours = expected.entries.keys() - skip, got.entries.keys() - skip
    for path in sorted(theirs - ours):
        out.append(Difference(path, "missing", expected.entries[path].kind.value))
    for path in sorted(ours - theirs):
        out.append(Difference(path, "extra", None, got.entries[path].kind.value))
    for path in sorted(theirs & ours):
        want, have = expected.entries[path], got.entries[path]
        for name in FIELDS:
            if name == "mtime" and path in skip_mtime:
                continue
            if getattr(want, name) != getattr(have, name):
                out.append(Difference(path, name, getattr(want, name), getattr(have, name)))
    want_groups = {g - skip for g in expected.link_groups()} - {frozenset()}
    have_groups = {g - skip for g in got.link_groups()} - {frozenset()}
    for group in sorted(want_groups - have_groups, key=sorted):
        out.append(Difference(",".join(sorted(group)), "hard links", "expected"))
    for group in sorted(have_groups - want_groups, key=sorted):
        out.append(Difference(",".join(sorted(group)), "hard links", None, "got"))
    return out
