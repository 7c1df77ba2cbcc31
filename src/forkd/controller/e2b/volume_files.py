"""A shared volume's files as E2B's content API reaches them, on the host: hostile ground.

Sandboxes write the volume through QEMU's 9p server in ``mapped-xattr`` mode: every
file on the host is a plain file or directory that QEMU's user made, and what the
guest sees of it (its owner, its mode, whether it is a symbolic link, a device or a
pipe) is kept in ``user.virtfs.*`` extended attributes. So:

- every path is walked from the volume's root one component at a time, each opened
  relative to its parent's descriptor with ``O_NOFOLLOW``: no ``..``, no link, no
  rename under way can lead a walk out of the volume;
- what this module makes it makes as QEMU would (modes open to every sandbox's QEMU
  user, the owner and mode the guest sees in the attributes), so sandboxes see it as
  their own files;
- what a guest made is described as the guest sees it, and a guest's "symbolic link"
  (a plain file holding its target) is reported as a link and never followed.

Writes are staged in the directory under a hidden name and renamed over the target
when whole. The volume's own filesystem bounds their size.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
from collections.abc import Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from forkd.errors import Conflict, GuestStorageFull, Invalid, NotFound

XATTR_UID, XATTR_GID, XATTR_MODE = "user.virtfs.uid", "user.virtfs.gid", "user.virtfs.mode"
MAX_COMPONENTS = 64
MAX_DEPTH = 16
MAX_LISTED = 10_000  # entries one listing returns at most
MAX_TARGET = 4096  # bytes of a guest's link target read back
READ_CHUNK = 1 << 20
PERMISSION_BITS = 0o7777
HOST_FILE_MODE, HOST_DIR_MODE = 0o666, 0o777  # every sandbox's QEMU user reads and writes
STAGING_PREFIX = ".forkd-upload-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in place of a file (by QEMU's user: no guest can) never blocks.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def components(path: str) -> list[str]:
    """``path`` (absolute or not, from the volume's root) as its components."""
    if not isinstance(path, str) or "\0" in path:
        raise Invalid(f"invalid path {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Invalid(f"{path!r}: '..' is not allowed in a volume's paths")
    if len(parts) > MAX_COMPONENTS:
        raise Invalid(f"{path!r} has more than {MAX_COMPONENTS} components")
    if any(len(p.encode()) > 255 for p in parts):
        raise Invalid(f"{path!r}: a name is longer than 255 bytes")
    return parts


def _shown(parts: list[str]) -> str:
    """The path an answer names: from the volume's root, absolute."""
    return "/" + "/".join(parts)


@contextlib.contextmanager
def _errors(where: str) -> Iterator[None]:
    """An ``OSError`` in the block as the error a caller gets: 404, 409, 400 or 507."""
    try:
        yield
    except OSError as exc:
        code = exc.errno
        if code == errno.ENOENT:
            raise NotFound(f"path {where!r} not found") from exc
        if code in (errno.EEXIST, errno.ENOTEMPTY):
            raise Conflict(f"{where!r} exists") from exc
        if code in (errno.ENOTDIR, errno.ELOOP, errno.EISDIR, errno.ENAMETOOLONG):
            raise Invalid(f"{where!r}: {os.strerror(code)}") from exc
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise GuestStorageFull(f"the volume is full ({where!r})") from exc
        raise


class VolumeFiles:
    """The files under one volume's ``data`` directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # ------------------------------------------------------------ walking

    @contextlib.contextmanager
    def _dir(self, parts: list[str], make: dict[str, int] | None = None) -> Iterator[int]:
        """A descriptor of the directory at ``parts``; ``make``: missing ones are made,
        with those owners and mode (E2B's ``force``)."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if make is None:
                        raise
                    _make_dir(fd, part, make)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reading

    def stat(self, path: str) -> dict[str, Any]:
        parts = components(path)
        with _errors(path), self._dir(parts[:-1]) as parent:
            return _entry(parent, parts[-1] if parts else ".", _shown(parts))

    def listing(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        if not 1 <= depth <= MAX_DEPTH:
            raise Invalid(f"depth must be 1 to {MAX_DEPTH}")
        parts = components(path)
        out: list[dict[str, Any]] = []
        with _errors(path), self._dir(parts) as fd:
            self._walk(fd, _shown(parts), depth, out)
        return out

    def _walk(self, fd: int, at: str, depth: int, out: list[dict[str, Any]]) -> None:
        names: list[str] = []
        with os.scandir(fd) as entries:  # read as it goes: a huge directory stops at the cap
            for dirent in entries:
                if len(out) + len(names) >= MAX_LISTED:
                    raise Invalid(f"more than {MAX_LISTED} entries: list a smaller depth")
                names.append(dirent.name)
        for name in sorted(names):
            if name.startswith(STAGING_PREFIX):
                continue
            try:
                entry = _entry(fd, name, f"{at.rstrip('/')}/{name}")
            except FileNotFoundError:
                continue  # removed since it was listed
            out.append(entry)
            if depth > 1 and entry["type"] == "directory":
                with contextlib.suppress(OSError):  # gone or changed since: skipped
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        self._walk(child, entry["path"], depth - 1, out)
                    finally:
                        os.close(child)

    def file_size(self, path: str) -> int:
        """The size of the regular file at ``path``: :class:`Invalid` for a directory or a
        guest's link, device or pipe (never followed, never opened)."""
        entry = self.stat(path)
        if entry["type"] != "file":
            raise Invalid(f"{path!r} is a {entry['type']}, not a file")
        return int(entry["size"])

    def chunks(self, path: str, size: int) -> Generator[bytes, None, None]:
        """The file's bytes (at most ``size``, what :meth:`file_size` said), opened only
        once the first is asked for and closed when the last is, or the reader leaves."""
        parts = components(path)
        with _errors(path), self._dir(parts[:-1]) as parent:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            left = size
            while left > 0 and (chunk := os.read(fd, min(READ_CHUNK, left))):
                left -= len(chunk)
                yield chunk
        finally:
            os.close(fd)

    # ------------------------------------------------------------ writing

    def make_dir(self, path: str, owner: dict[str, int], force: bool) -> dict[str, Any]:
        parts = components(path)
        if not parts:
            raise Conflict("the volume's root exists")
        with _errors(path), self._dir(parts[:-1], owner if force else None) as parent:
            try:
                _make_dir(parent, parts[-1], owner)
            except FileExistsError:
                if not force or not stat.S_ISDIR(os.stat(parts[-1], dir_fd=parent).st_mode):
                    raise
            return _entry(parent, parts[-1], _shown(parts))

    def begin_write(self, path: str, owner: dict[str, int]) -> Upload:
        """A write of the file at ``path`` (its missing parents made, an existing file
        replaced when the write is whole): fed chunk by chunk, then committed."""
        parts = components(path)
        if not parts:
            raise Invalid("the volume's root is a directory")
        parents = owner_of(owner["uid"], owner["gid"], None, 0o755)  # as make_dir's
        with _errors(path), self._dir(parts[:-1], parents) as parent:
            return Upload(os.dup(parent), parts[-1], path, owner)

    def write(self, path: str, chunks: Iterator[bytes], owner: dict[str, int]) -> dict[str, Any]:
        """The file at ``path`` made of ``chunks``, whole or not at all."""
        upload = self.begin_write(path, owner)
        try:
            for chunk in chunks:
                upload.write(chunk)
        except BaseException:
            upload.abort()
            raise
        return upload.commit()

    def update(self, path: str, changes: dict[str, int]) -> dict[str, Any]:
        """New owners or mode, as the guest sees them (E2B's ``update_metadata``)."""
        parts = components(path)
        with _errors(path), self._dir(parts[:-1]) as parent:
            name = parts[-1] if parts else "."
            fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
            try:
                now = _guest_attrs(fd, None, os.fstat(fd))
                kind = stat.S_IFMT(now["mode"])
                _set_guest_attrs(fd, {**now, **changes}, kind)
            finally:
                os.close(fd)
            return _entry(parent, name, _shown(parts))

    def remove(self, path: str) -> None:
        parts = components(path)
        if not parts:
            raise Invalid("the volume's root cannot be removed")
        with _errors(path), self._dir(parts[:-1]) as parent:
            st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _remove_tree(parent, parts[-1])
            else:
                os.unlink(parts[-1], dir_fd=parent)


class Upload:
    """A file being written: a staged, hidden file in its directory, renamed over the
    target when whole (:meth:`commit`), removed otherwise (:meth:`abort`)."""

    def __init__(self, parent: int, name: str, path: str, owner: dict[str, int]) -> None:
        self.parent, self.name, self.path, self.owner = parent, name, path, owner
        self.staged = f"{STAGING_PREFIX}{secrets.token_hex(6)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            with _errors(path):
                self.fd = os.open(self.staged, flags, 0o600, dir_fd=parent)
        except BaseException:
            os.close(parent)
            raise

    def write(self, chunk: bytes) -> None:
        with _errors(self.path):
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view) :]

    def commit(self) -> dict[str, Any]:
        try:
            with _errors(self.path):
                os.fchmod(self.fd, HOST_FILE_MODE)
                _set_guest_attrs(self.fd, self.owner, stat.S_IFREG)
                os.fsync(self.fd)
                os.rename(self.staged, self.name, src_dir_fd=self.parent, dst_dir_fd=self.parent)
                return _entry(self.parent, self.name, self.path)
        except BaseException:
            self.abort()
            raise
        finally:
            self._close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.staged, dir_fd=self.parent)
        self._close()

    def _close(self) -> None:
        for fd in (self.fd, self.parent):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self.parent = -1


def _entry(parent: int, name: str, path: str) -> dict[str, Any]:
    """What E2B's ``VolumeEntryStat`` says of ``name``: as a guest sees it."""
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    attrs = _guest_attrs(parent, name, st)
    kind = _kind(attrs["mode"])
    entry: dict[str, Any] = {
        "name": name if name != "." else "",
        "type": kind,
        "path": path,
        "size": st.st_size,
        "mode": attrs["mode"] & PERMISSION_BITS,
        "uid": attrs["uid"],
        "gid": attrs["gid"],
        "atime": _iso(st.st_atime),
        "mtime": _iso(st.st_mtime),
        "ctime": _iso(st.st_ctime),
    }
    if kind == "symlink" and stat.S_ISREG(st.st_mode):  # a guest's: its target in it
        fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
        try:
            entry["target"] = os.read(fd, MAX_TARGET).decode(errors="replace")
        finally:
            os.close(fd)
    return entry


def _remove_tree(parent: int, name: str) -> None:
    """Remove the directory ``name`` and all beneath it, by descriptor, never following a
    link, and without recursion: no depth a guest made stops it. It is first renamed
    to a hidden name, so it leaves listings at once."""
    doomed = f"{STAGING_PREFIX}rm-{secrets.token_hex(6)}"
    os.rename(name, doomed, src_dir_fd=parent, dst_dir_fd=parent)
    queue = [doomed]
    while queue:
        top = queue.pop()
        _empty(parent, top, queue)
        os.rmdir(top, dir_fd=parent)


def _empty(parent: int, top: str, queue: list[str]) -> None:
    """Empty ``top`` (in ``parent``), depth first, holding at most :data:`MAX_COMPONENTS`
    descriptors: a directory deeper than that is moved up into ``parent`` and queued."""
    stack = [(os.open(top, _DIR_FLAGS, dir_fd=parent), top)]
    try:
        while stack:
            fd = stack[-1][0]
            child = _first_directory(fd)  # the files before it are unlinked on the way
            if child is None:
                done, done_name = stack.pop()
                os.close(done)
                if stack:
                    os.rmdir(done_name, dir_fd=stack[-1][0])
            elif len(stack) >= MAX_COMPONENTS:
                moved = f"{STAGING_PREFIX}rm-{secrets.token_hex(6)}"
                os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=parent)
                queue.append(moved)
            else:
                stack.append((os.open(child, _DIR_FLAGS, dir_fd=fd), child))
    finally:
        for fd, _ in stack:
            os.close(fd)


def _first_directory(fd: int) -> str | None:
    """The first subdirectory of ``fd``, unlinking every other entry seen before it."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            os.unlink(entry.name, dir_fd=fd)
    return None


def owner_of(
    uid: int | None, gid: int | None, mode: int | None, default_mode: int
) -> dict[str, int]:
    """What a new entry's guest attributes are: root's unless told, ``default_mode``."""
    for name, value in (("uid", uid), ("gid", gid)):
        if value is not None and not 0 <= value < 1 << 32:
            raise Invalid(f"{name} {value} is out of range")
    if mode is not None and not 0 <= mode <= PERMISSION_BITS:
        raise Invalid(f"mode {mode:o} is not a permission mode (0 to 7777)")
    return {
        "uid": uid or 0,
        "gid": gid or 0,
        "mode": default_mode if mode is None else mode,
    }


def _make_dir(parent: int, name: str, owner: dict[str, int]) -> None:
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        os.fchmod(fd, HOST_DIR_MODE)
        _set_guest_attrs(fd, owner, stat.S_IFDIR)
    finally:
        os.close(fd)


def _set_guest_attrs(fd: int, owner: dict[str, int], kind: int) -> None:
    os.setxattr(fd, XATTR_UID, struct.pack("<I", owner["uid"]))
    os.setxattr(fd, XATTR_GID, struct.pack("<I", owner["gid"]))
    os.setxattr(fd, XATTR_MODE, struct.pack("<I", kind | (owner["mode"] & PERMISSION_BITS)))


def _guest_attrs(where: int, name: str | None, st: os.stat_result) -> dict[str, int]:
    """Owner and mode as the guest sees them: the attributes QEMU keeps, else the host's.

    ``where``: the entry's descriptor (``name`` None) or its parent's."""
    out = {"uid": st.st_uid, "gid": st.st_gid, "mode": st.st_mode}
    if name is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return out  # no link or node is made here: nothing to read attributes through
    for key, attr in (("uid", XATTR_UID), ("gid", XATTR_GID), ("mode", XATTR_MODE)):
        try:
            raw = (
                os.getxattr(where, attr)
                if name is None
                else os.getxattr(f"/proc/self/fd/{where}/{name}", attr, follow_symlinks=False)
            )
        except OSError:
            continue
        if len(raw) == 4:
            out[key] = struct.unpack("<I", raw)[0]
    if not (stat.S_IFMT(out["mode"])):
        out["mode"] |= stat.S_IFMT(st.st_mode)
    return out


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=UTC).isoformat().replace("+00:00", "Z")
