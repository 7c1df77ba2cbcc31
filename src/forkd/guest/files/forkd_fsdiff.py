"""What a sandbox changed in its root filesystem: a manifest of the overlay's upper layer.

The guest's root is an overlay (initramfs-init): the read-only image below, and
above it a tmpfs that holds every file the sandbox wrote since its template
booted. That upper layer is listed here; only what changed shows in it, so a
tree of 100 000 files the sandbox never touched costs nothing. initramfs-init
moves both layers under the new root: ``/mnt/rw/upper`` and ``/mnt/lower`` (a
container image's: under ``/opt/forkd/mnt``).

One manifest entry per line (JSON), for every path under the asked one that the
upper layer holds, a whiteout removed, or an opaque directory hides::

    [path, kind, size, mode, mtime_ns, link_target, lower]

``kind``: ``f`` file, ``d`` directory, ``l`` symbolic link, ``o`` other (fifo,
socket, device), ``-`` absent (removed: a whiteout, or hidden by an opaque
directory). ``lower`` is the same five fields of what the image holds at that
path, or null. The host compares two manifests (forkd.controller.services.diffs).
The last line is ``{"end": true, "truncated": bool, "entries": n}``.

Read in chunks like a tar download (``file_tar_read``). Standard library only.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

import forkd_files
from forkd_agent_params import RequestError

# Where initramfs-init leaves the overlay's layers: forkd's own image, a container image.
LAYERS = (
    ("/mnt/rw/upper", "/mnt/lower"),
    ("/opt/forkd/mnt/rw/upper", "/opt/forkd/mnt/lower"),
)
MAX_ENTRIES = 1_000_000
OPAQUE = "trusted.overlay.opaque"

Entry = list[Any]


def layers() -> tuple[str, str]:
    """The upper and lower directories of this guest's root overlay."""
    for upper, lower in LAYERS:
        if os.path.isdir(upper) and os.path.isdir(lower):
            return upper, lower
    raise RequestError("this guest's root is not forkd's overlay: its layers are not mounted")


def _fields(path: str) -> list[Any] | None:
    """kind, size, mode, mtime_ns, link target of ``path`` (not followed); None: none."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
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


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


class Walk:
    """The manifest of ``path``: entries as they are found, at most ``limit``."""

    def __init__(self, upper: str, lower: str, path: str, limit: int) -> None:
        self.upper, self.lower, self.path, self.limit = upper, lower, path, limit
        self.count = 0
        self.truncated = False

    def entries(self) -> Iterator[Entry]:
        hidden = self._hidden_above()
        if hidden is not None:  # an ancestor was removed or replaced: so is all of it
            yield from self._emit(self.path, hidden)
            return
        if _fields(self.upper + self.path) is not None:
            yield from self._visit(self.path)

    def _hidden_above(self) -> list[Any] | None:
        """An absent entry for ``path`` when an ancestor in the upper layer is a
        whiteout or no directory (what the image had there is gone)."""
        parts = [p for p in self.path.split("/") if p]
        for depth in range(1, len(parts)):
            above = self.upper + "/" + "/".join(parts[:depth])
            fields = _fields(above)
            if fields is not None and fields[0] != "d":
                return ["-", 0, 0, 0, None]
        return None

    def _emit(self, path: str, fields: list[Any]) -> Iterator[Entry]:
        if self.count >= self.limit:
            self.truncated = True
            return
        self.count += 1
        yield [path, *fields, _fields(self.lower + path)]

    def _visit(self, top: str) -> Iterator[Entry]:
        stack = [top]
        while stack and not self.truncated:
            path = stack.pop()
            fields = _fields(self.upper + path)
            if fields is None:  # gone meanwhile
                continue
            yield from self._emit(path, fields)
            if fields[0] != "d":
                continue
            base = "" if path == "/" else path
            try:
                names = sorted(os.listdir(self.upper + path), reverse=True)
            except OSError:
                continue
            stack.extend(f"{base}/{name}" for name in names)
            if _opaque(self.upper + path):
                yield from self._hidden_below(path)

    def _hidden_below(self, top: str) -> Iterator[Entry]:
        """What the image holds under the opaque directory ``top`` and the upper layer
        does not: hidden, so absent."""
        stack = [top]
        while stack and not self.truncated:
            path = stack.pop()
            base = "" if path == "/" else path
            try:
                names = sorted(os.listdir(self.lower + path), reverse=True)
            except OSError:
                continue
            for name in names:
                child = f"{base}/{name}"
                if not os.path.lexists(self.upper + child):
                    yield from self._emit(child, ["-", 0, 0, 0, None])
                below = _fields(self.lower + child)
                if below is not None and below[0] == "d":
                    stack.append(child)


def write_manifest(pipe: BinaryIO, walk: Walk) -> None:
    for entry in walk.entries():
        pipe.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
    end = {"end": True, "truncated": walk.truncated, "entries": walk.count}
    pipe.write(json.dumps(end).encode() + b"\n")


def op_fs_manifest_open(req: dict[str, Any]) -> dict[str, Any]:
    """Open the manifest of ``path`` (read with ``file_tar_read``): ``{"transfer_id",
    "lower"}``, ``lower`` the image's directory (to read what a file was before)."""
    path = os.path.normpath(forkd_files._path(req))
    path = "/" if path in ("/", "//") else path
    limit = forkd_files._int(req, "max_entries", 1, MAX_ENTRIES)
    upper, lower = layers()
    walk = Walk(upper.rstrip("/"), lower.rstrip("/"), path, limit)
    opened = forkd_files.TRANSFERS.add(
        lambda: forkd_files.ReadStream(lambda pipe: write_manifest(pipe, walk))
    )
    return {"transfer_id": opened, "lower": lower}


OPS = {"fs_manifest_open": op_fs_manifest_open}
