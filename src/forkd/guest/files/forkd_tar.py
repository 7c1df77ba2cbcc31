"""Tar streams of the forkd guest agent: a directory written as one, and one extracted
safely into a directory.

Imported by forkd_files.py, whose tar transfers run these on a thread at the
other end of a pipe. Standard library only, like the agent. Extraction never
writes outside its directory: see :func:`extract_tar`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from typing import BinaryIO

COPY_BYTES = 1024 * 1024  # of a member's content copied at once


class BadArchiveError(ValueError):
    """A tar upload that is not a tar archive, or ends in the middle of one."""


class UnsafeArchiveError(ValueError):
    """A tar member would land outside the target directory, or is a device."""


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, however many writes it takes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_tar(pipe: BinaryIO, path: str) -> None:
    """The directory ``path`` as a tar stream of its content (members "./..."); links
    are stored as links, never followed."""
    with tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.add(path, arcname=".", recursive=True)


# --------------------------------------------------------------------------- safe extraction


def _member_path(dest: str, name: str) -> str:
    """Where member ``name`` goes in ``dest``; UnsafeArchiveError if outside it."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise UnsafeArchiveError(f"refusing tar member {name!r}: absolute or with '..'")
    return os.path.join(dest, *parts) if parts else dest


def _inside(real_dest: str, path: str) -> bool:
    return path == real_dest or path.startswith(real_dest.rstrip("/") + "/")


def _check_link(real_dest: str, target: str, member: tarfile.TarInfo) -> None:
    """A symlink's target, resolved from where it is, must stay in the directory."""
    if member.linkname.startswith("/"):
        raise UnsafeArchiveError(f"refusing symlink {member.name!r}: absolute target")
    resolved = os.path.normpath(os.path.join(os.path.dirname(target), member.linkname))
    if not _inside(real_dest, resolved):
        raise UnsafeArchiveError(f"refusing symlink {member.name!r}: it points outside")


def _clear(path: str) -> None:
    """Remove a file or link in the way of a new member (a directory stays)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)


def extract_tar(pipe: BinaryIO, dest: str) -> None:
    """Extract the tar stream on ``pipe`` into ``dest``, member by member.

    Refused, before anything of them is written: absolute names, '..', links
    whose target is outside ``dest``, devices, and any member whose parent
    resolves outside ``dest`` (through a symlink already there).
    """
    real_dest = os.path.realpath(dest)
    try:
        _extract_members(pipe, real_dest)
    except tarfile.TarError as exc:
        raise BadArchiveError(f"not a valid tar archive: {exc}") from None


def _extract_members(pipe: BinaryIO, real_dest: str) -> None:
    with tarfile.open(fileobj=pipe, mode="r|") as tar:
        for member in tar:
            target = _member_path(real_dest, member.name)
            if target != real_dest:
                parent = os.path.dirname(target)
                # realpath resolves the links that exist, so this holds before any is made
                if not _inside(real_dest, os.path.realpath(parent)):
                    raise UnsafeArchiveError(f"refusing tar member {member.name!r}: outside")
                os.makedirs(parent, exist_ok=True)
            _extract_member(tar, member, real_dest, target)


def _extract_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, real_dest: str, target: str
) -> None:
    mode = member.mode & 0o777
    if member.isdir():
        if os.path.islink(target):
            os.unlink(target)
        os.makedirs(target, exist_ok=True)
        os.chmod(target, mode | 0o700)  # we must still write into it
    elif member.issym():
        _check_link(real_dest, target, member)
        _clear(target)
        os.symlink(member.linkname, target)
    elif member.islnk():
        source = _member_path(real_dest, member.linkname)
        if not _inside(real_dest, os.path.realpath(source)):
            raise UnsafeArchiveError(f"refusing hard link {member.name!r}: it points outside")
        _clear(target)
        os.link(source, target, follow_symlinks=False)
    elif member.isreg():
        _clear(target)
        _copy_member(tar, member, target, mode)
    else:
        raise UnsafeArchiveError(f"refusing tar member {member.name!r}: not a file, dir or link")


def _copy_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: str, mode: int) -> None:
    source = tar.extractfile(member)
    assert source is not None  # a regular member always has content
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(target, flags, 0o600)
    try:
        while piece := source.read(COPY_BYTES):
            write_all(fd, piece)
        os.fchmod(fd, mode)
    except OSError:  # a full disk among them: forkd_files names it
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise
    os.close(fd)
    with contextlib.suppress(OSError):
        os.utime(target, (member.mtime, member.mtime))
