"""Unpacking an untrusted tar stream beneath one directory, and nowhere else.

Every archive forkd unpacks goes through :func:`extract`: a volume's content
on the daemon's host, a directory copied out of a sandbox on the client's,
an upload into a sandbox in its guest, and an image's layers.

How it stays beneath its target, on any Python and without ``tarfile``'s
filters:

- Names are checked before anything is done with them: no absolute name, no
  ``..``, no NUL, no empty component; within the reader's bounds on length,
  depth, entries and bytes.
- Every operation is relative to a directory descriptor, reached from the
  target one component at a time with ``O_NOFOLLOW | O_DIRECTORY``: a symlink
  (or a file) where a directory must be is refused, never followed, whoever
  put it there and whatever its target. Nothing is ever written through an
  existing name: a file is unlinked and created anew with ``O_EXCL``.
- A hard link's source is found the same way, beneath the target, and linked
  without following it.
- Under the ``DATA`` policy a symlink must point inside the tree, also once
  later archives unpacked into the same directory changed the links around it:
  its target is relative, its ``..`` all come first and climb no higher than
  the root (``../../a/b``, not ``a/../../b``). Every symlink made is then
  resolved once more, through the links as they now stand, beneath the root.
  Devices and fifos are refused; owners, setuid/setgid/sticky bits, group/other
  write bits and extended attributes are not applied.
- Under the ``ROOTFS`` policy (an image's root file system) symlinks are
  stored as written, whatever their target: they are meant for the guest's
  root, and nothing here follows them. Owners, modes, devices and the
  extended attributes a root file system needs are applied.

Directories' modes and times are applied last, deepest first, so a read-only
directory in the archive does not stop its own content from being written. The
names' checks, the walks by descriptor and the symlinks' last resolution are
:mod:`forkd.archive.beneath`'s; this module makes the entries.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.archive.beneath import (
    check_resolves_inside,
    link_problem,
    readlink,
    split_name,
    walk,
)
from forkd.archive.errors import ArchiveError, BadArchive, UnsafeEntry, shown
from forkd.archive.tar_format import Kind, Limits, Member, ReadFn, TarReader

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What an archive can bring about by itself (a name too long for the file system, a
# file where its own directory must go, ...), as opposed to the host's own failures.
_ARCHIVE_ERRNOS = frozenset(
    {
        errno.ENAMETOOLONG,
        errno.EMLINK,
        errno.EINVAL,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.EISDIR,
        errno.ELOOP,
        errno.ENOTEMPTY,
    }
)
# The extended attributes a root file system may carry; others are not applied.
ROOTFS_XATTR_PREFIXES = ("user.", "security.capability")


@dataclass(frozen=True)
class Policy:
    """What an archive's entries may be and keep beyond plain files, directories and
    links inside the tree."""

    name: str
    symlinks_inside: bool  # a symlink must lead inside the tree
    devices: bool  # character and block devices, fifos
    owners: bool  # the archive's uid and gid (the extracting process must be root)
    all_mode_bits: bool  # setuid, setgid, sticky and group/other write kept
    xattrs: bool  # ROOTFS_XATTR_PREFIXES applied


DATA = Policy("data", True, False, False, False, False)
ROOTFS = Policy("rootfs", False, True, True, True, True)
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Extracted:
    entries: int
    bytes: int  # regular files' sizes, summed


def extract(
    read: ReadFn,
    dest: str | os.PathLike[str] | int,
    policy: Policy = DATA,
    limits: Limits = DEFAULT_LIMITS,
) -> Extracted:
    """Unpack the tar stream that ``read(n)`` yields into the existing directory
    ``dest`` (a path, or an open descriptor of it); raises an
    :class:`~forkd.archive.errors.ArchiveError` for an archive refused (what was
    written before stays: unpack into a fresh directory and remove it on failure,
    as :func:`extract_new` does)."""
    if isinstance(dest, int):
        root = os.dup(dest)
    else:
        root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _Unpacker(root, policy, TarReader(read, limits)).run()
    finally:
        os.close(root)


def extract_new(
    read: ReadFn,
    dest: str | os.PathLike[str],
    policy: Policy = DATA,
    limits: Limits = DEFAULT_LIMITS,
) -> Extracted:
    """Unpack into ``dest``, which must not exist yet: the archive is unpacked into
    a hidden directory beside it and renamed into place when whole, so a refused or
    broken archive leaves nothing behind."""
    target = Path(dest)
    # A new name, made here (not one an earlier archive unpacked beside it could hold).
    staging = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".forkd-partial", dir=target.parent)
    )
    try:
        done = extract(read, staging, policy, limits)
        os.rename(staging, target)  # refuses to replace an existing directory that is not empty
    except BaseException:
        _remove_tree(staging)
        raise
    return done


class ChunkReader:
    """A ``read(n)`` over an iterable of byte chunks, holding at most one chunk."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buffer = memoryview(b"")

    def read(self, n: int) -> bytes:
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._buffer = memoryview(chunk)
        piece, self._buffer = self._buffer[:n], self._buffer[n:]
        return bytes(piece)


def _remove_tree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            import shutil  # only on failure

            shutil.rmtree(path)  # never follows a symlink (fd-based on Linux)


# ---------------------------------------------------------------------- unpacking


class _Unpacker:
    def __init__(self, root: int, policy: Policy, reader: TarReader) -> None:
        self.root = root
        self.policy = policy
        self.reader = reader
        self.directories: dict[tuple[str, ...], Member] = {}  # modes and times applied last
        self.symlinks: list[tuple[str, ...]] = []
        self._cached: tuple[tuple[str, ...], int] | None = None  # the last parent opened

    def run(self) -> Extracted:
        try:
            for member in self.reader:
                try:
                    self._one(member)
                except OSError as exc:
                    if exc.errno not in _ARCHIVE_ERRNOS:
                        raise  # the host's: a full disk, no permission, an I/O error
                    raise BadArchive(
                        f"cannot unpack entry {shown(member.name)}: {exc.strerror}"
                    ) from None
            if self.policy.symlinks_inside:
                try:
                    for parts in self.symlinks:
                        check_resolves_inside(self.root, parts)
                except UnsafeEntry:
                    self._remove_symlinks()  # none is left to lead out, even unstaged
                    raise
            self._finish_directories()
        finally:
            self._forget_parent()
        return Extracted(self.reader.entries, self.reader.bytes)

    def _one(self, member: Member) -> None:
        parts = split_name(member.name)
        if not parts:
            if member.kind is not Kind.DIRECTORY:
                raise UnsafeEntry(f"refusing entry {shown(member.name)}: not a directory")
            if self.policy.owners:  # the root's own mode and owner, for an image's /
                self.directories[()] = member
            return
        parent = self._parent(member, parts[:-1])
        name = parts[-1]
        kind = member.kind
        if kind is Kind.DIRECTORY:
            self._directory(parent, name, member)
            self.directories[parts] = member
        elif kind is Kind.FILE:
            self._clear(parent, parts, member)
            self._file(parent, name, member)
        elif kind is Kind.SYMLINK:
            self._symlink(parent, name, member, parts)
        elif kind is Kind.HARDLINK:
            self._hardlink(parent, parts, member)
        else:
            self._device(parent, parts, member)

    # -------------------------------------------------------------- directories to walk

    def _parent(self, member: Member, parts: tuple[str, ...]) -> int:
        """A descriptor of the directory ``parts`` beneath the root, made where missing;
        UnsafeEntry where a component is a symlink or not a directory."""
        if self._cached is not None and self._cached[0] == parts:
            return self._cached[1]
        self._forget_parent()
        fd = walk(self.root, parts, member.name, create=True)
        self._cached = (parts, fd)
        return fd

    def _forget_parent(self) -> None:
        if self._cached is not None:
            if self._cached[1] != self.root:
                os.close(self._cached[1])
            self._cached = None

    # -------------------------------------------------------------- entries

    def _clear(self, parent: int, parts: tuple[str, ...], member: Member) -> None:
        """Whatever has ``name`` goes before a new entry takes it; a directory only when
        empty. Nothing is ever written through an existing name."""
        name = parts[-1]
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            return
        try:
            os.rmdir(name, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise BadArchive(
                    f"entry {shown(member.name)} would replace a directory that is not empty"
                ) from None
            raise
        self.directories.pop(parts, None)

    def _directory(self, parent: int, name: str, member: Member) -> None:
        try:
            st = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=parent)
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            os.mkdir(name, 0o700, dir_fd=parent)

    def _file(self, parent: int, name: str, member: Member) -> None:
        fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        try:
            self._fill(fd, member)
        except BaseException:  # a full disk among them: no half-written file is left
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=parent)
            raise
        finally:
            os.close(fd)

    def _fill(self, fd: int, member: Member) -> None:
        end = 0
        for offset, piece in self.reader.chunks():
            if offset != end:
                os.lseek(fd, offset, os.SEEK_SET)
            _write_all(fd, piece)
            end = offset + len(piece)
        if member.sparse is not None:
            os.ftruncate(fd, member.size)
        self._attributes(fd, member)
        os.utime(fd, (member.mtime, member.mtime))

    def _attributes(self, fd: int, member: Member) -> None:
        """Owner, then mode (a chown clears setuid), then extended attributes."""
        if self.policy.owners:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, self._mode(member))
        self._xattrs(fd, member)

    def _xattrs(self, fd: int, member: Member) -> None:
        if self.policy.xattrs:
            for key, value in member.xattrs.items():
                if key.startswith(ROOTFS_XATTR_PREFIXES):
                    os.setxattr(fd, key, value)

    def _mode(self, member: Member) -> int:
        if self.policy.all_mode_bits:
            return member.mode & 0o7777
        mode = member.mode & 0o755
        return mode | (0o700 if member.kind is Kind.DIRECTORY else 0o600)

    def _symlink(self, parent: int, name: str, member: Member, parts: tuple[str, ...]) -> None:
        target = member.linkname
        if not target or "\0" in target:
            raise UnsafeEntry(f"refusing symlink {shown(member.name)}: an empty or NUL target")
        if self.policy.symlinks_inside:
            if target.startswith("/"):
                raise UnsafeEntry(
                    f"refusing symlink {shown(member.name)}: its target is an absolute path"
                )
            problem = link_problem(parts[:-1], target)
            if problem is not None:
                raise UnsafeEntry(f"refusing symlink {shown(member.name)}: {problem}")
            self.symlinks.append(parts)
        self._clear(parent, parts, member)
        os.symlink(target, name, dir_fd=parent)
        if self.policy.owners:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        with contextlib.suppress(OSError):
            os.utime(name, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)

    def _hardlink(self, parent: int, parts: tuple[str, ...], member: Member) -> None:
        try:
            source = split_name(member.linkname) if member.linkname else ()
        except UnsafeEntry:
            raise UnsafeEntry(
                f"refusing hard link {shown(member.name)}: its target is absolute, climbs "
                "with '..' or holds a NUL"
            ) from None
        if not source:
            raise UnsafeEntry(f"refusing hard link {shown(member.name)}: no target")
        if source == parts:
            return  # a link to itself: already there
        source_dir = walk(self.root, source[:-1], member.name, create=False)
        try:
            try:
                st = os.lstat(source[-1], dir_fd=source_dir)
            except FileNotFoundError:
                raise UnsafeEntry(
                    f"refusing hard link {shown(member.name)}: its target "
                    f"{shown(member.linkname)} does not exist"
                ) from None
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeEntry(f"refusing hard link {shown(member.name)}: to a directory")
            if not self.policy.devices and not stat.S_ISREG(st.st_mode):
                raise UnsafeEntry(
                    f"refusing hard link {shown(member.name)}: to something not a regular file"
                )
            self._clear(parent, parts, member)
            os.link(
                source[-1],
                parts[-1],
                src_dir_fd=source_dir,
                dst_dir_fd=parent,
                follow_symlinks=False,
            )
        finally:
            if source_dir != self.root:
                os.close(source_dir)

    def _device(self, parent: int, parts: tuple[str, ...], member: Member) -> None:
        if not self.policy.devices:
            raise UnsafeEntry(
                f"refusing entry {shown(member.name)}: a {member.kind.value} "
                "(only files, directories and links are unpacked here)"
            )
        self._clear(parent, parts, member)
        name = parts[-1]
        kind = {
            Kind.CHAR_DEVICE: stat.S_IFCHR,
            Kind.BLOCK_DEVICE: stat.S_IFBLK,
            Kind.FIFO: stat.S_IFIFO,
        }[member.kind]
        device = os.makedev(member.devmajor, member.devminor) if kind != stat.S_IFIFO else 0
        os.mknod(name, kind | (member.mode & 0o777), device, dir_fd=parent)
        if self.policy.owners:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        # Permission bits through a descriptor that cannot be a device's open:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{fd}", member.mode & 0o7777)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(name, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)

    # -------------------------------------------------------------- the end

    def _remove_symlinks(self) -> None:
        self._forget_parent()
        for parts in self.symlinks:
            with contextlib.suppress(ArchiveError, OSError):
                if readlink(self.root, parts, "/".join(parts)) is not None:
                    fd = walk(self.root, parts[:-1], "", False)
                    try:
                        os.unlink(parts[-1], dir_fd=fd)
                    finally:
                        if fd != self.root:
                            os.close(fd)

    def _finish_directories(self) -> None:
        """Each directory's mode, owner and time, the deepest first."""
        for parts in sorted(self.directories, key=len, reverse=True):
            member = self.directories[parts]
            fd = walk(self.root, parts, member.name, create=False) if parts else os.dup(self.root)
            try:
                if self.policy.owners:
                    os.fchown(fd, member.uid, member.gid)
                if parts or self.policy.all_mode_bits:
                    os.fchmod(fd, self._mode(member))
                self._xattrs(fd, member)
                os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
