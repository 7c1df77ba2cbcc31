"""What a sandbox changed in its root filesystem: a manifest of the overlay's upper layer.

The guest's root is an overlay (initramfs-init): the read-only image below, and
above it a tmpfs that holds every file the sandbox wrote since its template
booted. That upper layer is listed here; only what changed shows in it, so a
tree of 100 000 files the sandbox never touched costs nothing. initramfs-init
moves both layers under the new root: ``/mnt/rw/upper`` and ``/mnt/lower`` (a
container image's: under ``/opt/forkd/mnt``).

One manifest entry per line (JSON), for every path under the asked one that the
upper layer holds, a whiteout removed, or an opaque directory hides::

    [path, kind, size, mode, mtime_ns, link_target]

``kind``: ``f`` file, ``d`` directory, ``l`` symbolic link, ``o`` other (fifo,
socket, device), ``-`` absent (removed: a whiteout, or hidden by an opaque
directory). The last line is ``{"end": true, "truncated": bool, "entries": n}``.
Read in chunks like a tar download (``file_tar_read``). One stat per entry, and
the lines formatted by hand: under TCG the guest's Python is the cost.

What the image holds at a path (``fs_lower_stat``) is asked apart, for the few
paths only one side of a comparison lists. The host compares
(forkd.controller.services.manifests). Standard library only.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring_ascii as _string  # C; quotes too
from typing import Any, BinaryIO

import forkd_files
import forkd_fsfind
from forkd_agent_params import RequestError

from forkd import agent_wire as wire
from forkd.agent_wire import MAX_LOWER_PATHS, MAX_MANIFEST_ENTRIES

# Where initramfs-init leaves the overlay's layers: forkd's own image, a container image.
LAYERS = (
    ("/mnt/rw/upper", "/mnt/lower"),
    ("/opt/forkd/mnt/rw/upper", "/opt/forkd/mnt/lower"),
)
OPAQUE = "trusted.overlay.opaque"


def layers() -> tuple[str, str]:
    """The upper and lower directories of this guest's root overlay."""
    for upper, lower in LAYERS:
        if os.path.isdir(upper) and os.path.isdir(lower):
            return upper, lower
    raise RequestError("this guest's root is not forkd's overlay: its layers are not mounted")


_ABSENT = ["-", 0, 0, 0, None]


def _stat_fields(st: os.stat_result, path: str) -> list[Any]:
    """kind, size, mode, mtime_ns, link target of the entry ``st`` is of."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        kind = "f"
    elif stat.S_ISDIR(mode):
        kind = "d"
    elif stat.S_ISLNK(mode):
        kind = "l"
    elif stat.S_ISCHR(mode) and st.st_rdev == 0:
        kind = "-"  # an overlay whiteout: removed from the image
    else:
        kind = "o"
    target = os.readlink(path) if kind == "l" else None
    size = st.st_size if kind in ("f", "l") else 0
    return [kind, size, stat.S_IMODE(mode), st.st_mtime_ns, target]


def _fields(path: str) -> list[Any] | None:
    """The fields of ``path`` (not followed); None: nothing there."""
    try:
        return _stat_fields(os.lstat(path), path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _line(path: str, fields: list[Any]) -> bytes:
    kind, size, mode, mtime, target = fields
    link = "null" if target is None else _string(target)
    return b'[%s,"%s",%d,%d,%d,%s]\n' % (
        _string(path).encode(),
        kind.encode(),
        size,
        mode,
        mtime,
        link.encode(),
    )


class Walk:
    """The manifest of ``path``: its lines as they are found, at most ``limit``."""

    def __init__(self, upper: str, lower: str, path: str, limit: int) -> None:
        self.upper, self.lower, self.path, self.limit = upper, lower, path, limit
        self.count = 0
        self.truncated = False

    def lines(self) -> Iterator[bytes]:
        if self._hidden_above():  # an ancestor was removed or replaced: so is all of it
            yield from self._emit(self.path, _ABSENT)
            return
        top = _fields(self.upper + self.path)
        if top is not None:
            yield from self._emit(self.path, top)
            if top[0] == "d":
                yield from self._visit(self.path)

    def _hidden_above(self) -> bool:
        """Whether an ancestor of ``path`` in the upper layer is a whiteout or no
        directory (what the image had there is gone)."""
        parts = [p for p in self.path.split("/") if p]
        for depth in range(1, len(parts)):
            fields = _fields(self.upper + "/" + "/".join(parts[:depth]))
            if fields is not None and fields[0] != "d":
                return True
        return False

    def _emit(self, path: str, fields: list[Any]) -> Iterator[bytes]:
        if self.count >= self.limit:
            self.truncated = True
            return
        self.count += 1
        yield _line(path, fields)

    def _visit(self, top: str) -> Iterator[bytes]:
        stack = [top]
        while stack and not self.truncated:
            path = stack.pop()
            base = "" if path == "/" else path
            try:
                with os.scandir(self.upper + path) as found:
                    children = list(found)
            except OSError:  # gone meanwhile
                continue
            for child in children:
                name = f"{base}/{child.name}"
                try:
                    fields = _stat_fields(child.stat(follow_symlinks=False), child.path)
                except OSError:
                    continue
                yield from self._emit(name, fields)
                if fields[0] == "d":
                    stack.append(name)
            if _opaque(self.upper + path):
                yield from self._hidden_below(path)

    def _hidden_below(self, top: str) -> Iterator[bytes]:
        for path in self.hidden_paths(top):
            yield from self._emit(path, _ABSENT)

    def hidden_paths(self, top: str) -> Iterator[str]:
        """What the image holds under the opaque directory ``top`` and the upper layer
        does not: hidden, so absent."""
        stack = [top]
        while stack and not self.truncated:
            path = stack.pop()
            base = "" if path == "/" else path
            try:
                with os.scandir(self.lower + path) as found:
                    children = list(found)
            except OSError:
                continue
            for child in children:
                name = f"{base}/{child.name}"
                if not os.path.lexists(self.upper + name):
                    yield name
                if child.is_dir(follow_symlinks=False):
                    stack.append(name)

    # What forkd_fsfind asks of a walk it does with find.

    def top_fields(self) -> list[Any] | None:
        """The asked path's fields: absent when an ancestor hides it; None: nothing there."""
        return _ABSENT if self._hidden_above() else _fields(self.upper + self.path)

    def fields(self, path: str) -> list[Any] | None:
        """The upper layer's fields of ``path``."""
        return _fields(self.upper + path)

    def opaque(self, path: str) -> bool:
        return _opaque(self.upper + path)


def write_manifest(pipe: BinaryIO, walk: Walk) -> None:
    batch: list[bytes] = []
    for line in walk.lines():
        batch.append(line)
        if len(batch) >= 512:
            pipe.write(b"".join(batch))
            batch.clear()
    end = {"end": True, "truncated": walk.truncated, "entries": walk.count}
    batch.append(json.dumps(end).encode() + b"\n")
    pipe.write(b"".join(batch))


def op_fs_manifest_open(req: dict[str, Any]) -> wire.ManifestAnswer:
    """Open the manifest of ``path`` (read with ``file_tar_read``): ``{"transfer_id",
    "lower", "format"}``, ``lower`` the image's directory (to read what a file was
    before); ``format`` ``records`` when GNU find lists it (forkd_fsfind), else
    ``lines`` (this module's walk)."""
    path = _normal(forkd_files._path(req))
    limit = forkd_files._int(req, "max_entries", 1, MAX_MANIFEST_ENTRIES)
    upper, lower = layers()
    walk = Walk(upper.rstrip("/"), lower.rstrip("/"), path, limit)
    find = forkd_fsfind.gnu_find()
    if find is None:
        write: Callable[[BinaryIO], None] = lambda pipe: write_manifest(pipe, walk)  # noqa: E731
    else:
        write = forkd_fsfind.FindWalk(find, walk).write
    opened = forkd_files.TRANSFERS.add(lambda: forkd_files.ReadStream(write))
    return {"transfer_id": opened, "lower": lower, "format": "lines" if find is None else "records"}


def op_fs_lower_stat(req: dict[str, Any]) -> wire.LowerStatAnswer:
    """What the image holds at each of ``paths``: ``{"stats": [fields or null, ...]}``."""
    paths = req.get("paths")
    if not isinstance(paths, list) or len(paths) > MAX_LOWER_PATHS:
        raise ValueError(f"'paths' must be a list of at most {MAX_LOWER_PATHS} paths")
    lower = layers()[1].rstrip("/")
    normal = [_normal(forkd_files._path({"path": p})) for p in paths]
    return {"stats": [_fields(lower + p) for p in normal]}


def _normal(path: str) -> str:
    path = os.path.normpath(path)
    return "/" if path.startswith("//") else path


OPS = {"fs_manifest_open": op_fs_manifest_open, "fs_lower_stat": op_fs_lower_stat}
