"""The guest agent's entry and watch ops (forkd_entries.py, forkd_watch.py) played over a
fake guest's files (``GuestContents.files``: path to bytes; a directory is a prefix of
some file's path, or one ``fs_mkdir`` made). Answers are checked against the wire as
the real guest's are.

A fake watch compares the files under its directory at each read with what it saw at
the last (the real one is the guest kernel's inotify, tested in test_agent_watch.py):
enough to drive the daemon's streams and polls.
"""

from __future__ import annotations

import itertools
import posixpath
from collections.abc import Callable
from typing import Any

from forkd import agent_wire_entries as entries
from forkd.errors import AgentError
from forkd.vmm.agent.answers import checked

_ids = itertools.count(1)


def _missing(path: str) -> AgentError:
    return AgentError(f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError")


class FakeEntries:
    """The ops over ``files()`` (the guest's files) and the directories made here."""

    def __init__(self, files: Callable[[], dict[str, bytes]], home: Callable[[str | None], str]):
        self._files = files
        self._home = home
        self.dirs: set[str] = {"/", "/root", "/tmp"}  # as an image has them
        self._watches: dict[str, tuple[str, bool, dict[str, int]]] = {}

    def _abs(self, path: str, user: str | None) -> str:
        return posixpath.normpath(posixpath.join(self._home(user), path))

    def _is_dir(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/"
        return path in self.dirs or any(p.startswith(prefix) for p in self._files())

    def _entry(self, path: str) -> entries.FsEntry:
        files = self._files()
        if path in files:
            kind, size, mode = "file", len(files[path]), 0o644
        elif self._is_dir(path):
            kind, size, mode = "dir", 4096, 0o755
        else:
            raise _missing(path)
        found: entries.FsEntry = {
            "name": posixpath.basename(path) or "/",
            "path": path,
            "type": kind,
            "size": size,
            "mode": mode,
            "permissions": ("d" if kind == "dir" else "-") + "rw-r--r--",
            "owner": "root",
            "group": "root",
            "mtime": 1_700_000_000.0,
        }
        return found

    def stat(self, path: str, user: str | None) -> entries.FsEntry:
        return checked(entries.FS_STAT, dict(self._entry(self._abs(path, user))))

    def _children(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        below = [p for p in [*self._files(), *self.dirs] if p.startswith(prefix) and p != path]
        return sorted({prefix + p[len(prefix) :].split("/")[0] for p in below})

    def list(self, path: str, depth: int, user: str | None) -> entries.FsListAnswer:
        root = self._abs(path, user)
        if root in self._files():
            raise AgentError(f"[Errno 20] Not a directory: {root!r}", kind="NotADirectoryError")
        if not self._is_dir(root):
            raise _missing(root)
        found, level = [], [root]
        for _ in range(depth):
            level = [c for d in level for c in self._children(d)]
            found += [self._entry(c) for c in level]
            level = [c for c in level if self._is_dir(c)]
        answer = {"entries": sorted(found, key=lambda e: e["path"]), "truncated": False}
        return checked(entries.FS_LIST, answer)

    def mkdir(self, path: str, user: str | None) -> entries.FsMkdirAnswer:
        made = self._abs(path, user)
        if made in self._files():
            raise AgentError(f"[Errno 17] File exists: {made!r}", kind="FileExistsError")
        created = not self._is_dir(made)
        while made != "/":
            self.dirs.add(made)
            made = posixpath.dirname(made)
        answer = {"created": created, "entry": self._entry(self._abs(path, user))}
        return checked(entries.FS_MKDIR, answer)

    def move(self, source: str, destination: str, user: str | None) -> entries.FsEntry:
        src, dst = self._abs(source, user), self._abs(destination, user)
        files = self._files()
        if src not in files and not self._is_dir(src):
            raise _missing(src)
        for old in [p for p in files if p == src or p.startswith(src + "/")]:
            files[dst + old[len(src) :]] = files.pop(old)
        self.dirs = {dst + d[len(src) :] if d.startswith(src) else d for d in self.dirs}
        return checked(entries.FS_MOVE, dict(self._entry(dst)))

    # watches ------------------------------------------------------------------
    def _seen(self, root: str, recursive: bool) -> dict[str, int]:
        prefix = root.rstrip("/") + "/"
        return {
            p[len(prefix) :]: len(data)
            for p, data in self._files().items()
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])
        }

    def watch_open(self, path: str, recursive: bool) -> str:
        if not self._is_dir(path):
            raise _missing(path)
        watch_id = f"w{next(_ids)}"
        self._watches[watch_id] = (path, recursive, self._seen(path, recursive))
        return watch_id

    def watch_read(self, watch_id: str) -> entries.WatchReadAnswer:
        if watch_id not in self._watches:
            raise AgentError(f"no watch {watch_id!r}", kind="LookupError")
        root, recursive, before = self._watches[watch_id]
        now = self._seen(root, recursive)
        events: list[dict[str, Any]] = [
            {"name": n, "type": "create"} for n in now if n not in before
        ]
        events += [{"name": n, "type": "write"} for n in now if n in before and now[n] != before[n]]
        events += [{"name": n, "type": "remove"} for n in before if n not in now]
        self._watches[watch_id] = (root, recursive, now)
        return checked(entries.WATCH_READ, {"events": events, "overflowed": False})

    def watch_close(self, watch_id: str) -> bool:
        return self._watches.pop(watch_id, None) is not None
