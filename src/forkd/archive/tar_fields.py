"""The fields of a tar header, each read as the format states it and bounded before use.

Numbers (octal, or GNU's base-256), names (ustar's prefix joined), the header's
checksum, pax records and what forkd takes from them (sizes, owners, times,
extended attributes), and the sparse maps GNU and pax format 0.x store in a
header. :class:`forkd.archive.tar_format.TarReader` reads the stream and asks
these for each field; none of them reads the stream itself. Standard library
only: the guest agent imports it too.
"""

from __future__ import annotations

import re

from forkd.archive.errors import ArchiveTooLarge, BadArchive, shown

BLOCK = 512
MAX_SPARSE_SEGMENTS = 1 << 16
MAX_XATTRS = 64
MAX_XATTR_VALUE = 64 * 1024  # Linux's own limit on one attribute's value
_POSIX_MAGIC = b"ustar\x0000"
_PAX_LENGTH = re.compile(rb"([0-9]{1,8}) ")


def padded(size: int) -> int:
    """``size`` rounded up to whole blocks: what a payload of that size takes."""
    return -(-size // BLOCK) * BLOCK


def until_nul(raw: bytes) -> bytes:
    """A NUL-terminated field's bytes (all of it when it fills its room)."""
    return raw.split(b"\0", 1)[0]


def text(raw: bytes) -> str:
    """A name's bytes as the file system will get them back (os.fsencode)."""
    return raw.decode("utf-8", "surrogateescape")


def header_name(block: bytes) -> str:
    name = until_nul(block[0:100])
    if block[257:265] == _POSIX_MAGIC:
        prefix = until_nul(block[345:500])
        if prefix:
            name = prefix + b"/" + name
    return text(name)


def number(raw: bytes, what: str, *, negative: int | None = None) -> int:
    """An octal field, or GNU's base-256 (first byte 0x80; 0xff, negative, is refused,
    or read as ``negative`` when given)."""
    if raw[:1] == b"\x80":
        return int.from_bytes(raw[1:], "big")
    if raw[:1] == b"\xff":
        if negative is not None:
            return negative
        raise BadArchive(f"the archive has a negative number for {what}")
    digits = raw.split(b"\0", 1)[0].strip(b" ")
    if not digits:
        return 0
    if not all(48 <= c <= 55 for c in digits):
        raise BadArchive(f"the archive has a malformed number for {what}: {digits[:20]!r}")
    return int(digits, 8)


def check_sum(block: bytes) -> None:
    """BadArchive unless the header's checksum matches, summed signed or unsigned."""
    stored = block[148:156]
    try:
        want = number(stored, "a checksum")
    except BadArchive:
        raise BadArchive("not a tar archive: a header's checksum is malformed") from None
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    signed = unsigned - 2 * (
        sum(b for b in block[:148] if b > 127) + sum(b for b in block[156:] if b > 127)
    )
    if want not in (unsigned, signed):
        raise BadArchive("not a tar archive (a header's checksum does not match)")


def pax_records(payload: bytes) -> dict[bytes, bytes]:
    """``LEN key=value\\n`` records; LEN counts the whole record, itself included."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(payload):
        if payload[pos] == 0:  # some writers pad with NULs
            break
        m = _PAX_LENGTH.match(payload, pos)
        if m is None:
            raise BadArchive("a pax header is malformed")
        length = int(m.group(1))
        end = pos + length
        if length <= len(m.group(0)) or end > len(payload) or payload[end - 1] != 0x0A:
            raise BadArchive("a pax header is malformed")
        key, sep, value = payload[m.end() : end - 1].partition(b"=")
        if not sep or not key:
            raise BadArchive("a pax header is malformed")
        if key.startswith(b"GNU.sparse.offset") or key.startswith(b"GNU.sparse.numbytes"):
            # Format 0.0 repeats these two: keep every one, in order.
            records[key + b"#" + str(len(records)).encode()] = value
        else:
            records[key] = value
        pos = end
    return records


def pax_int(pax: dict[bytes, bytes], key: bytes, default: int) -> int:
    if key not in pax:
        return default
    value = pax[key]
    if not value.isdigit() or len(value) > 20:
        raise BadArchive(f"a pax header has a malformed {key.decode(errors='replace')}")
    return int(value)


def pax_time(pax: dict[bytes, bytes], default: int) -> int:
    value = pax.get(b"mtime")
    if value is None:
        return default
    whole = value.split(b".", 1)[0]
    if whole.startswith(b"-"):
        return 0
    if not whole.isdigit() or len(whole) > 20:
        raise BadArchive("a pax header has a malformed mtime")
    return int(whole)


def pax_xattrs(pax: dict[bytes, bytes], name: str) -> dict[str, bytes]:
    found = {}
    for key, value in pax.items():
        if key.startswith(b"SCHILY.xattr."):
            attr = key[len(b"SCHILY.xattr.") :]
            if not attr or b"\0" in attr or len(attr) > 255:
                raise BadArchive(f"entry {shown(name)} has a malformed extended attribute")
            if len(value) > MAX_XATTR_VALUE:
                raise ArchiveTooLarge(f"entry {shown(name)} has an extended attribute too large")
            found[text(attr)] = value
    if len(found) > MAX_XATTRS:
        raise ArchiveTooLarge(f"entry {shown(name)} has more than {MAX_XATTRS} attributes")
    return found


# ---------------------------------------------------------------------- sparse maps


def runs_from(raw: bytes, count: int) -> list[tuple[int, int]]:
    """Up to ``count`` (offset, length) pairs of an old GNU sparse header, 12 bytes
    each, until the first empty one."""
    runs = []
    for i in range(count):
        entry = raw[i * 24 : i * 24 + 24]
        if entry[:1] in (b"\0", b"") and entry[12:13] in (b"\0", b""):
            break
        runs.append((number(entry[:12], "a sparse offset"), number(entry[12:], "a sparse length")))
    return runs


def pax_0_runs(pax: dict[bytes, bytes], name: str) -> list[tuple[int, int]]:
    """A pax sparse map of format 0.1 (``GNU.sparse.map``) or 0.0 (repeated offset and
    numbytes records, in order)."""
    if b"GNU.sparse.map" in pax:
        numbers = pax[b"GNU.sparse.map"].split(b",")
        if len(numbers) % 2 or not all(n.isdigit() for n in numbers):
            raise BadArchive(f"entry {shown(name)} has a malformed sparse map")
        values = [int(n) for n in numbers]
    else:
        ordered = sorted(
            (int(k.rsplit(b"#", 1)[1]), v)
            for k, v in pax.items()
            if k.startswith(b"GNU.sparse.offset#") or k.startswith(b"GNU.sparse.numbytes#")
        )
        if not all(v.isdigit() for _, v in ordered):
            raise BadArchive(f"entry {shown(name)} has a malformed sparse map")
        values = [int(v) for _, v in ordered]
        if len(values) % 2:
            raise BadArchive(f"entry {shown(name)} has a malformed sparse map")
    if len(values) > 2 * MAX_SPARSE_SEGMENTS:
        raise ArchiveTooLarge(f"a sparse file has more than {MAX_SPARSE_SEGMENTS} data runs")
    return list(zip(values[0::2], values[1::2], strict=True))
