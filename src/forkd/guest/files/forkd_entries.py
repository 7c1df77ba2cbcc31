"""The guest agent's entry ops, a file or directory as E2B's envd describes one: ``fs_stat``
(one entry), ``fs_list`` (a directory to a depth), ``fs_mkdir`` (with its parents, owned
by the request's user) and ``fs_move``.

An entry is a path with its type, size, permission bits, the names of its owner and
group, its modification time and, for a symlink, its target; symlinks are described,
never followed. A relative path is the request user's home's (as envd resolves one).
Imported from the agent's own directory. Standard library only.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import forkd_agent_command as command
import forkd_agent_params as params
import forkd_identity
from forkd_agent_params import RequestError

from forkd import agent_wire_entries as wire
from forkd.agent_wire import MAX_LIST_ENTRIES
from forkd.agent_wire_entries import MAX_FS_LIST_BYTES, MAX_LIST_DEPTH

ENTRY_OVERHEAD = 200  # bytes of JSON an entry takes beside its name and path


def _path(req: dict[str, Any], home: str, name: str = "path") -> str:
    """The request's ``name``: absolute as given, or under ``home``; normalised."""
    value = req.get(name)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name!r} must be a non-empty string")
    if "\0" in value:
        raise RequestError(f"{name!r} must not contain a NUL byte")
    return os.path.normpath(os.path.join(home, value))


def kind_of(mode: int) -> str:
    """An entry's type by its mode: file, dir, symlink or other."""
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "other"


class _Names:
    """Owner and group names by id, from the guest's own /etc/passwd and /etc/group
    (read once per request, as the identity module reads them: without NSS)."""

    def __init__(self) -> None:
        self._users: dict[int, str] | None = None
        self._groups: dict[int, str] | None = None

    def user(self, uid: int) -> str:
        if self._users is None:
            self._users = forkd_identity.names_by_id(forkd_identity.PASSWD)
        return self._users.get(uid, str(uid))

    def group(self, gid: int) -> str:
        if self._groups is None:
            self._groups = forkd_identity.names_by_id(forkd_identity.GROUP)
        return self._groups.get(gid, str(gid))


def entry(path: str, names: _Names | None = None) -> wire.FsEntry:
    """``path`` described (lstat: a symlink is itself); FileNotFoundError if missing."""
    names = names or _Names()
    st = os.lstat(path)
    described: wire.FsEntry = {
        "name": os.path.basename(path) or "/",
        "path": path,
        "type": kind_of(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "permissions": stat.filemode(st.st_mode),
        "owner": names.user(st.st_uid),
        "group": names.group(st.st_gid),
        "mtime": st.st_mtime,
    }
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        described["symlink_target"] = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return described


def op_fs_stat(req: dict[str, Any]) -> wire.FsEntry:
    return entry(_path(req, command.identity(req).home))


def op_fs_list(req: dict[str, Any]) -> wire.FsListAnswer:
    """The entries below ``path`` to ``depth`` levels (1: its own), in path order, at
    most MAX_LIST_ENTRIES of them and about MAX_FS_LIST_BYTES; directories are entered,
    symlinks are not."""
    root = _path(req, command.identity(req).home)
    depth = params.int_param(req, "depth", 1, MAX_LIST_DEPTH, default=1)
    if not stat.S_ISDIR(os.stat(root).st_mode):  # the root may be a link to a directory
        raise NotADirectoryError(f"not a directory: {root!r}")
    names = _Names()
    found: list[wire.FsEntry] = []
    truncated = False
    size = 0
    level = [root]
    for _ in range(depth):
        below: list[str] = []
        for directory in level:
            try:
                children = sorted(os.listdir(directory))
            except (PermissionError, FileNotFoundError, NotADirectoryError):
                continue  # changed while listed, or closed to the agent: skipped
            for child in children:
                if len(found) >= MAX_LIST_ENTRIES or size >= MAX_FS_LIST_BYTES:
                    truncated = True
                    break
                try:
                    described = entry(os.path.join(directory, child), names)
                except FileNotFoundError:  # removed while listed
                    continue
                found.append(described)
                size += ENTRY_OVERHEAD + 2 * len(described["path"]) + len(child)
                if described["type"] == "dir":
                    below.append(described["path"])
        level = below
    found.sort(key=lambda e: e["path"])
    return {"entries": found, "truncated": truncated}


def op_fs_mkdir(req: dict[str, Any]) -> wire.FsMkdirAnswer:
    """``path`` made, with its missing parents, each owned by the request's user; an
    existing directory is no error (``created`` false), anything else there is."""
    who = command.identity(req)
    path = _path(req, who.home)
    if os.path.isdir(path) and not os.path.islink(path):
        return {"created": False, "entry": entry(path)}
    missing: list[str] = []
    parent = path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(path)  # FileExistsError / NotADirectoryError as they come
    for made in reversed(missing):  # never through a link swapped in meanwhile
        os.chown(made, who.uid, who.gid, follow_symlinks=False)
    return {"created": True, "entry": entry(path)}


def op_fs_move(req: dict[str, Any]) -> wire.FsEntry:
    """``source`` renamed to ``destination`` (both within the guest; a directory with
    its contents); the destination's entry."""
    home = command.identity(req).home
    source, destination = _path(req, home, "source"), _path(req, home, "destination")
    if not os.path.normpath(source).strip("/"):
        raise RequestError("refusing to move '/'")
    os.rename(source, destination)
    return entry(destination)


OPS = {
    "fs_stat": op_fs_stat,
    "fs_list": op_fs_list,
    "fs_mkdir": op_fs_mkdir,
    "fs_move": op_fs_move,
}
