"""Builders of tar archives for the extractor's tests, hostile ones among them.

Standard library only, like :mod:`forkd.archive`: these tests also run on the
newest Python the project supports, in a venv that holds nothing but pytest
and hypothesis.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable

Entry = Callable[[tarfile.TarFile], None]


def archive(*entries: Entry, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for add in entries:
            add(tar)
    return buf.getvalue()


def _info(name: str, kind: bytes, **fields: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = 1_700_000_000
    for key, value in fields.items():
        setattr(info, key, value)
    return info


def file(name: str, data: bytes = b"x", mode: int = 0o644, **fields: object) -> Entry:
    def add(tar: tarfile.TarFile) -> None:
        tar.addfile(
            _info(name, tarfile.REGTYPE, size=len(data), mode=mode, **fields), io.BytesIO(data)
        )

    return add


def directory(name: str, mode: int = 0o755, **fields: object) -> Entry:
    return lambda tar: tar.addfile(_info(name, tarfile.DIRTYPE, mode=mode, **fields))


def symlink(name: str, target: str) -> Entry:
    return lambda tar: tar.addfile(_info(name, tarfile.SYMTYPE, linkname=target, mode=0o777))


def hardlink(name: str, target: str) -> Entry:
    return lambda tar: tar.addfile(_info(name, tarfile.LNKTYPE, linkname=target, mode=0o644))


def device(name: str, kind: bytes = tarfile.CHRTYPE, major: int = 1, minor: int = 3) -> Entry:
    return lambda tar: tar.addfile(_info(name, kind, devmajor=major, devminor=minor, mode=0o666))


def pax_header(name: str, records: dict[str, str], data: bytes = b"x") -> Entry:
    def add(tar: tarfile.TarFile) -> None:
        info = _info(name, tarfile.REGTYPE, size=len(data), mode=0o644)
        info.pax_headers = records
        tar.addfile(info, io.BytesIO(data))

    return add


# ---------------------------------------------------------------------- published attacks


def path_max_chain(escape_to: str, steps: str = "abcdefghijklmnop") -> list[Entry]:
    """CVE-2025-4517's published shape: directories with 247-character names, each
    reached through a one-letter symlink, so that resolving the last link's real path
    passes PATH_MAX (where ``os.path.realpath`` gives up and returns it unresolved);
    then ``escape``, a symlink through that chain climbing out to ``escape_to``,
    followed by a symlink, a hard link and a file written through it."""
    component = "d" * 247
    entries: list[Entry] = []
    path = ""
    for step in steps:
        entries.append(directory(f"{path}{component}"))
        entries.append(symlink(f"{path}{step}", component))
        path = f"{path}{component}/"
    link_path = "/".join([*steps, "l" * 254])
    entries.append(symlink(link_path, "../" * len(steps)))
    climb = "../" * (escape_to.count("/") + 8)
    entries.append(symlink("escape", f"{link_path}/{climb}{escape_to.lstrip('/')}"))
    entries.append(symlink("escape/link", "/etc/passwd"))
    entries.append(hardlink("escape/hard", "escape/victim"))
    entries.append(file("escape/victim", b"overwritten by the archive"))
    return entries


def chunks(data: bytes, size: int) -> Iterable[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def raw_header(name: bytes, kind: bytes = b"0", size_field: bytes | None = None) -> bytes:
    """One ustar header block written by hand, for fields tarfile would not write."""
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"0000644\0"
    block[108:116] = b"0000000\0"
    block[116:124] = b"0000000\0"
    block[124:136] = size_field if size_field is not None else b"00000000000\0"
    block[136:148] = b"00000000000\0"
    block[156:157] = kind
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)
