"""A streaming reader of tar archives that trusts nothing in them.

Written for forkd rather than taken from ``tarfile``: the standard library's
reader holds a whole pax or long-name header in memory, has had parser bugs
fixed only in later patch releases (backtracking on pax headers, loops on
crafted offsets) that Debian 12's Python 3.11.2 still carries, and leaves the
bounds to the caller. This one reads ustar, GNU (long names and links, old
sparse files, base-256 numbers) and pax (paths, sizes, owners, times, extended
attributes, sparse formats 0.0, 0.1 and 1.0) from a forward-only stream, and
bounds every length it is told before it reads a byte of it.

Each header's fields are read by :mod:`forkd.archive.tar_fields`. The reader only
parses; :mod:`forkd.archive.unpack` decides what an entry may do on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from forkd.archive.errors import ArchiveTooLarge, BadArchive, shown
from forkd.archive.tar_fields import (
    BLOCK,
    MAX_SPARSE_SEGMENTS,
    check_sum,
    header_name,
    number,
    padded,
    pax_0_runs,
    pax_int,
    pax_records,
    pax_time,
    pax_xattrs,
    runs_from,
    text,
    until_nul,
)

MAX_META_HEADERS = 8  # long-name, long-link and pax headers before one entry
HEADER_BLOCKS_PER_ENTRY = 8  # a header, a pax header and its records, a long name: room to spare

ReadFn = Callable[[int], bytes]


class Kind(Enum):
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"
    HARDLINK = "hardlink"
    CHAR_DEVICE = "char device"
    BLOCK_DEVICE = "block device"
    FIFO = "fifo"


_KINDS = {
    b"0": Kind.FILE,
    b"\0": Kind.FILE,
    b"7": Kind.FILE,
    b"S": Kind.FILE,
    b"1": Kind.HARDLINK,
    b"2": Kind.SYMLINK,
    b"3": Kind.CHAR_DEVICE,
    b"4": Kind.BLOCK_DEVICE,
    b"5": Kind.DIRECTORY,
    b"6": Kind.FIFO,
}
_META = (b"L", b"K", b"x", b"g")  # GNU long name, GNU long link, pax, pax global
_OLD_GNU_SPARSE = b"S"


@dataclass(frozen=True)
class Limits:
    """What one archive may hold; over any is :class:`ArchiveTooLarge`."""

    max_entries: int = 100_000
    max_bytes: int = 1 << 30  # regular files' apparent sizes, summed
    max_header_bytes: int = 1 << 20  # one pax or long-name header's payload
    max_path_bytes: int = 4096  # PATH_MAX: a name or a link target
    max_depth: int = 256  # components in one name


@dataclass
class Member:
    """One entry as the archive states it; ``name`` and ``linkname`` are not yet checked."""

    name: str
    kind: Kind
    size: int  # the file's apparent size (a sparse file's holes included)
    mode: int
    uid: int
    gid: int
    mtime: int
    linkname: str = ""
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    # (offset, length) of each data run of a sparse file, in order; None: not sparse
    sparse: list[tuple[int, int]] | None = None


def max_stream(limits: Limits) -> int:
    """The longest tar stream ``limits`` allow: headers cost a few blocks an entry beyond
    the content, so a stream longer than this is padding or headers piled up (a
    compressed bomb of them), not content."""
    return (
        limits.max_bytes
        + limits.max_entries * HEADER_BLOCKS_PER_ENTRY * BLOCK
        + MAX_META_HEADERS * limits.max_header_bytes
    )


class TarReader:
    """The members of a tar stream in order; read each one's content with :meth:`read`
    before moving on (what is left unread is skipped)."""

    def __init__(self, read: ReadFn, limits: Limits) -> None:
        self._read = read
        self.limits = limits
        # Headers cost a few blocks an entry beyond the content: a stream longer than
        # this is padding or headers piled up (a compressed bomb of them), not content.
        self.max_stream = max_stream(limits)
        self.stream = 0
        self.entries = 0
        self.bytes = 0  # apparent sizes of the files so far
        self._left = 0  # stored bytes of the current member not yet read
        self._padding = 0
        self._runs: list[tuple[int, int]] = []  # a sparse member's runs not yet read
        self._ended = False

    # ------------------------------------------------------------------ raw bytes

    def _read_raw(self, n: int) -> bytes:
        data = self._read(n)
        self.stream += len(data)
        if self.stream > self.max_stream:
            raise ArchiveTooLarge(
                f"the archive is longer than {self.max_stream} bytes, more than its "
                "entries and content can take"
            )
        return data

    def _exactly(self, n: int, what: str) -> bytes:
        parts = []
        while n > 0:
            piece = self._read_raw(min(n, 1 << 20))
            if not piece:
                raise BadArchive(f"the archive ends in the middle of {what}")
            parts.append(piece)
            n -= len(piece)
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        while n > 0:
            step = min(n, 1 << 20)
            self._exactly(step, "an entry's content")
            n -= step

    # ------------------------------------------------------------------ members

    def __iter__(self) -> Iterator[Member]:
        while not self._ended:
            self._skip(self._left + self._padding)
            self._left = self._padding = 0
            member = self._next()
            if member is None:
                self._ended = True
                return
            yield member

    def _next(self) -> Member | None:
        long_name: str | None = None
        long_link: str | None = None
        pax: dict[bytes, bytes] = {}
        for _ in range(MAX_META_HEADERS + 1):
            block = self._read_block()
            if block is None:
                return None
            kind = block[156:157]
            if kind not in _META:
                return self._member(block, long_name, long_link, pax)
            size = number(block[124:136], "a header's size")
            if size > self.limits.max_header_bytes:
                raise ArchiveTooLarge(
                    f"the archive has a {size}-byte extended header; at most "
                    f"{self.limits.max_header_bytes} bytes are accepted"
                )
            payload = self._exactly(padded(size), "an extended header")[:size]
            if kind == b"L":
                long_name = text(payload.split(b"\0", 1)[0])
            elif kind == b"K":
                long_link = text(payload.split(b"\0", 1)[0])
            elif kind == b"x":
                pax.update(pax_records(payload))
            # b"g": global pax headers change nothing forkd keeps; read and dropped
        raise BadArchive(f"more than {MAX_META_HEADERS} extended headers before one entry")

    def _read_block(self) -> bytes | None:
        """The next header block, or None at the archive's end (a zero block, or EOF
        where a header would start)."""
        first = self._read_raw(BLOCK)
        if not first:
            return None
        block = (
            first if len(first) == BLOCK else first + self._exactly(BLOCK - len(first), "a header")
        )
        if block == bytes(BLOCK):
            return None
        check_sum(block)
        return block

    def _member(
        self, block: bytes, long_name: str | None, long_link: str | None, pax: dict[bytes, bytes]
    ) -> Member:
        kind_flag = block[156:157]
        name = long_name if long_name is not None else header_name(block)
        if b"path" in pax:
            name = text(pax[b"path"])
        linkname = long_link if long_link is not None else text(until_nul(block[157:257]))
        if b"linkpath" in pax:
            linkname = text(pax[b"linkpath"])
        kind = _KINDS.get(kind_flag)
        if kind is None:
            raise BadArchive(
                f"entry {shown(name)} is of a type forkd does not unpack ({kind_flag!r})"
            )
        if kind is Kind.FILE and name.endswith("/") and kind_flag != _OLD_GNU_SPARSE:
            kind = Kind.DIRECTORY  # the old v7 way of storing a directory
        stored = pax_int(pax, b"size", number(block[124:136], "a size"))
        member = Member(
            name=name,
            kind=kind,
            size=stored,
            mode=number(block[100:108], "a mode") & 0o7777,
            uid=pax_int(pax, b"uid", number(block[108:116], "an owner")),
            gid=pax_int(pax, b"gid", number(block[116:124], "a group")),
            # A time before 1970 reads as 0, in GNU's base-256 as in pax: GNU tar
            # writes one for any file dated so, and Docker takes such a layer.
            mtime=pax_time(pax, number(block[136:148], "a time", negative=0)),
            linkname=linkname,
            devmajor=number(block[329:337], "a device number"),
            devminor=number(block[337:345], "a device number"),
            xattrs=pax_xattrs(pax, name),
        )
        self._check_bounds(member)
        if kind is Kind.FILE:
            self._left = stored
            self._padding = padded(stored) - stored
            member.sparse = self._sparse_map(block, kind_flag, pax, member)
            self.bytes += member.size
            if self.bytes > self.limits.max_bytes:
                raise ArchiveTooLarge(
                    f"the archive unpacks to more than {self.limits.max_bytes} bytes "
                    f"(at entry {shown(member.name)})"
                )
        else:  # no content to unpack, but a size may still say some follows: skipped
            self._left, self._padding = stored, padded(stored) - stored
            self.bytes += stored
            if self.bytes > self.limits.max_bytes:
                raise ArchiveTooLarge(
                    f"the archive holds more than {self.limits.max_bytes} bytes "
                    f"(at entry {shown(member.name)})"
                )
        return member

    def _check_bounds(self, member: Member) -> None:
        self.entries += 1
        limits = self.limits
        if self.entries > limits.max_entries:
            raise ArchiveTooLarge(f"the archive has more than {limits.max_entries} entries")
        for what, value in (("name", member.name), ("link target", member.linkname)):
            if len(value.encode("utf-8", "surrogateescape")) > limits.max_path_bytes:
                raise ArchiveTooLarge(
                    f"entry {shown(member.name)} has a {what} longer than "
                    f"{limits.max_path_bytes} bytes"
                )
        if member.name.count("/") > limits.max_depth:
            raise ArchiveTooLarge(
                f"entry {shown(member.name)} is more than {limits.max_depth} directories deep"
            )

    # ------------------------------------------------------------------ sparse files

    def _sparse_map(
        self, block: bytes, kind_flag: bytes, pax: dict[bytes, bytes], member: Member
    ) -> list[tuple[int, int]] | None:
        if kind_flag == _OLD_GNU_SPARSE:
            runs = self._old_gnu_runs(block)
            member.size = number(block[483:495], "a sparse file's size")
        elif pax.get(b"GNU.sparse.major") == b"1":
            runs, consumed = self._pax_1_runs()
            self._left -= consumed
            member.size = pax_int(pax, b"GNU.sparse.realsize", 0)
            if b"GNU.sparse.name" in pax:
                member.name = text(pax[b"GNU.sparse.name"])
        elif b"GNU.sparse.map" in pax or b"GNU.sparse.numblocks" in pax:
            runs = pax_0_runs(pax, member.name)
            member.size = pax_int(pax, b"GNU.sparse.size", pax_int(pax, b"GNU.sparse.realsize", 0))
            if b"GNU.sparse.name" in pax:
                member.name = text(pax[b"GNU.sparse.name"])
        else:
            return None
        _check_runs(runs, member, self._left)
        self._runs = list(runs)
        return runs

    def _old_gnu_runs(self, block: bytes) -> list[tuple[int, int]]:
        runs = runs_from(block[386:482], 4)
        extended = block[482]
        while extended:
            more = self._exactly(BLOCK, "a sparse file's map")
            self._too_many_runs(runs)
            runs += runs_from(more[:504], 21)
            extended = more[504]
        return runs

    def _pax_1_runs(self) -> tuple[list[tuple[int, int]], int]:
        """The map that format 1.0 stores at the start of the data: decimal lines, the
        count then offset and length pairs, padded to a block."""
        lines: list[int] = []
        consumed = 0
        buffer = b""
        wanted = None
        while wanted is None or len(lines) < 1 + 2 * wanted:
            if b"\n" not in buffer:
                if consumed >= self._left or len(buffer) > 64:
                    raise BadArchive("a sparse file's map is malformed")
                buffer += self._exactly(BLOCK, "a sparse file's map")
                consumed += BLOCK
                continue
            line, buffer = buffer.split(b"\n", 1)
            if not line.isdigit():
                raise BadArchive("a sparse file's map is malformed")
            lines.append(int(line))
            if wanted is None:
                wanted = lines[0]
                if wanted > MAX_SPARSE_SEGMENTS:
                    raise ArchiveTooLarge(
                        f"a sparse file has more than {MAX_SPARSE_SEGMENTS} data runs"
                    )
        return list(zip(lines[1::2], lines[2::2], strict=True)), consumed

    def _too_many_runs(self, runs: list[tuple[int, int]]) -> None:
        if len(runs) > MAX_SPARSE_SEGMENTS:
            raise ArchiveTooLarge(f"a sparse file has more than {MAX_SPARSE_SEGMENTS} data runs")

    # ------------------------------------------------------------------ content

    def chunks(self, size: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
        """The current member's content as (offset in the file, bytes), holes skipped."""
        if not self._runs:
            offset = 0
            while self._left:
                piece = self._exactly(min(size, self._left), "an entry's content")
                self._left -= len(piece)
                yield offset, piece
                offset += len(piece)
            return
        while self._runs:
            offset, length = self._runs.pop(0)
            while length:
                piece = self._exactly(min(size, length), "an entry's content")
                self._left -= len(piece)
                length -= len(piece)
                yield offset, piece
                offset += len(piece)


def _check_runs(runs: list[tuple[int, int]], member: Member, stored: int) -> None:
    """Runs in order, not overlapping, inside the file, and adding up to what is stored."""
    end = 0
    for offset, length in runs:
        if offset < end or offset + length > member.size:
            raise BadArchive(f"entry {shown(member.name)} has a sparse map out of order or bounds")
        end = offset + length
    if sum(length for _, length in runs) != stored:
        raise BadArchive(f"entry {shown(member.name)}'s sparse map does not match its content")
