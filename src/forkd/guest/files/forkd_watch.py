"""Filesystem change notifications of the forkd guest agent: inotify watches on a
directory (and, asked, the tree below it), read as batches of named events.

Ops ``fs_watch_open``, ``fs_watch_read`` and ``fs_watch_close`` (:data:`OPS`). The
events come from the guest's kernel (inotify(7), called through ctypes on the C
library); the tree is never polled. Event kinds are those Go's fsnotify reports:
``create``, ``write``, ``remove``, ``rename`` and ``chmod``, each named by its path
relative to the watched root (the root itself is ``""``).

A watch is memory and file descriptors of the agent that a vanished host, or a fork
of the VM, leaves open: at most :data:`MAX_WATCHES` are kept, one unread for
:data:`IDLE_SECS` is closed, and each keeps at most :data:`MAX_PENDING_EVENTS`
unanswered events and :data:`MAX_WATCHED_DIRS` directories; what is lost past a
bound (or past the kernel's own queue) is told by the next read's ``overflowed``.
Standard library only, like the agent.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import secrets
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import forkd_agent_params as params

from forkd import agent_wire_entries as wire
from forkd.agent_wire_entries import WatchEvent, WatchReadAnswer

MAX_WATCHES = 64  # watches open at once
MAX_WATCHED_DIRS = 4096  # directories of one recursive watch, its root counted
MAX_PENDING_EVENTS = 10_000  # events read from the kernel and not yet answered, per watch
IDLE_SECS = 600.0  # a watch unread this long is closed
MAX_WAIT_S = wire.MAX_WATCH_WAIT_S  # the longest a read waits for a first event
DEFAULT_MAX_EVENTS = 1000
MAX_READ_EVENTS = wire.MAX_WATCH_EVENTS  # the most events one read answers
READ_BUFFER_BYTES = 64 * 1024  # room for hundreds of events; one needs at most 272

# inotify(7), <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

WATCHED_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
ROOT_MASK = WATCHED_MASK | IN_ONLYDIR  # the root may be a symlink to a directory
BELOW_MASK = WATCHED_MASK | IN_ONLYDIR | IN_DONT_FOLLOW  # as the walk: links not followed

# Each kernel event carries one of these bits (and maybe IN_ISDIR).
KINDS: tuple[tuple[int, wire.EventKind], ...] = (
    (IN_CREATE | IN_MOVED_TO, "create"),
    (IN_MODIFY, "write"),
    (IN_DELETE | IN_DELETE_SELF, "remove"),
    (IN_MOVED_FROM | IN_MOVE_SELF, "rename"),
    (IN_ATTRIB, "chmod"),
)


class Inotify:
    """The C library's inotify calls, each raising OSError as the os module's calls do."""

    def __init__(self) -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)  # the C library Python runs on
            init1, add, rm = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
        except (ImportError, OSError, AttributeError) as exc:
            raise OSError(errno.ENOSYS, f"no inotify in this guest: {exc}") from None
        init1.argtypes = [ctypes.c_int]
        add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        rm.argtypes = [ctypes.c_int, ctypes.c_int]
        init1.restype = add.restype = rm.restype = ctypes.c_int
        self._init1, self._add, self._rm = init1, add, rm
        self._errno = ctypes.get_errno

    def _checked(self, result: int, *filename: str) -> int:
        if result < 0:
            err = self._errno()
            raise OSError(err, os.strerror(err), *filename)  # FileNotFoundError for ENOENT...
        return result

    def init(self) -> int:
        """A new inotify file descriptor, non-blocking and closed on exec."""
        try:
            return self._checked(int(self._init1(os.O_NONBLOCK | os.O_CLOEXEC)))
        except OSError as exc:
            if exc.errno == errno.ENOSYS:  # a kernel built without CONFIG_INOTIFY_USER
                raise OSError(errno.ENOSYS, f"no inotify in this guest: {exc}") from None
            raise

    def add_watch(self, fd: int, path: str, mask: int) -> int:
        return self._checked(int(self._add(fd, os.fsencode(path), mask)), path)

    def rm_watch(self, fd: int, wd: int) -> None:
        self._checked(int(self._rm(fd, wd)))


@functools.cache
def _inotify() -> Inotify:
    """Loaded at the first open (a failure is not kept: each open tries again)."""
    return Inotify()


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel and name else rel or name


def _kind(mask: int) -> wire.EventKind | None:
    for bits, kind in KINDS:
        if mask & bits:
            return kind
    return None


# --------------------------------------------------------------------------- one watch


class Watch:
    """One inotify instance: the directories it watches by their paths below the root,
    and the events read from the kernel not yet answered. Its table serialises reads
    under ``lock``; fds are closed only under it."""

    def __init__(self, inotify: Inotify, root: str, recursive: bool) -> None:
        self.lock = threading.Lock()
        self.used_at = 0.0
        self.closed = False
        self._inotify = inotify
        self._root = root
        self._recursive = recursive
        self._paths: dict[int, str] = {}  # watch descriptor -> path below the root
        self._pending: deque[WatchEvent] = deque()
        self._overflowed = False  # events were lost since the last read
        self._fd = inotify.init()
        self._wake_r = self._wake_w = -1
        try:
            # A close writes here to end a read waiting on the watch at once.
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._paths[inotify.add_watch(self._fd, root, ROOT_MASK)] = ""
            if recursive:
                self._watch_tree("", announce=False)
        except BaseException:
            self._close_fds()
            raise

    def shut(self) -> None:
        """Close the watch: a read waiting on it is woken, and fails (called once)."""
        self.closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        with self.lock:
            self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1

    def read(self, max_events: int, wait_s: float) -> WatchReadAnswer:
        """Up to ``max_events`` events, waiting up to ``wait_s`` for a first; called
        with ``lock`` held. Those left over stay for the next read."""
        deadline = time.monotonic() + wait_s
        self._drain(max_events)
        while not self._pending and not self._overflowed and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait(left):
                break
            self._drain(max_events)  # what came may all be dropped (a subdirectory's own)
        count = min(max_events, len(self._pending))
        events = [self._pending.popleft() for _ in range(count)]
        overflowed, self._overflowed = self._overflowed, False
        return {"events": events, "overflowed": overflowed}

    def _wait(self, timeout_s: float) -> bool:
        """Whether the kernel has events within ``timeout_s`` (False when woken by a close)."""
        poller = select.poll()  # not select.select: the agent's fds may pass 1023
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ready = dict(poller.poll(math.ceil(timeout_s * 1000)))
        return bool(ready.get(self._fd, 0) & select.POLLIN)

    def _drain(self, enough: int) -> None:
        """Take what the kernel has queued, until it has no more or ``enough`` are
        pending (the rest waits in the kernel's queue, which tells its own overflow)."""
        while len(self._pending) < enough:
            try:
                data = os.read(self._fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                return
            if not data:
                return
            offset = 0
            while offset + EVENT_HEADER.size <= len(data):
                wd, mask, _cookie, length = EVENT_HEADER.unpack_from(data, offset)
                start = offset + EVENT_HEADER.size
                name = data[start : start + length].split(b"\0", 1)[0]
                self._take(wd, mask, os.fsdecode(name))
                offset = start + length

    def _take(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._overflowed = True
            return
        if mask & IN_IGNORED:  # the watch is gone: its directory removed, or unwatched
            self._paths.pop(wd, None)
            return
        rel = self._paths.get(wd)
        kind = _kind(mask)
        # A subdirectory's events about itself are told by its parent's watch already.
        if rel is None or kind is None or (rel and not name):
            return
        path = _join(rel, name)
        self._queue(path, kind)
        if self._recursive and mask & IN_ISDIR and name:
            if mask & IN_MOVED_FROM:
                self._unwatch(path)  # moved away, or to a name its IN_MOVED_TO watches
            elif mask & (IN_CREATE | IN_MOVED_TO) and self._watch_dir(path):
                # A directory just made may hold entries made before it was watched.
                self._watch_tree(path, announce=bool(mask & IN_CREATE))

    def _queue(self, path: str, kind: wire.EventKind) -> None:
        if len(self._pending) >= MAX_PENDING_EVENTS:
            self._overflowed = True
        else:
            self._pending.append({"name": path, "type": kind})

    def _full(self, rel: str) -> str:
        return os.path.join(self._root, rel) if rel else self._root

    def _watch_dir(self, rel: str) -> bool:
        """Watch the directory at ``rel``; False when it is gone, or past a bound."""
        if len(self._paths) >= MAX_WATCHED_DIRS:
            self._overflowed = True  # its events will be missing
            return False
        try:
            wd = self._inotify.add_watch(self._fd, self._full(rel), BELOW_MASK)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # the kernel's fs.inotify.max_user_watches
                self._overflowed = True
            return False  # gone meanwhile, unreadable, or a symlink now
        self._paths[wd] = rel
        return True

    def _watch_tree(self, top: str, announce: bool) -> None:
        """Watch every directory below ``top`` (watched already), each before it is
        listed, so one made meanwhile comes as an event. With ``announce``, the entries
        found are queued as created (a just made directory's entries may be older than
        its watch; one made after the watch may then come twice)."""
        stack = [top]
        while stack:
            rel = stack.pop()
            try:
                with os.scandir(self._full(rel)) as entries:
                    found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            except OSError:
                continue  # removed meanwhile, or unreadable
            for name, is_dir in sorted(found):
                path = _join(rel, name)
                if announce:
                    self._queue(path, "create")
                if is_dir and self._watch_dir(path):
                    stack.append(path)

    def _unwatch(self, rel: str) -> None:
        """Stop watching the directory at ``rel`` and those below it (moved)."""
        below = rel + "/"
        gone = [wd for wd, path in self._paths.items() if path == rel or path.startswith(below)]
        for wd in gone:
            del self._paths[wd]
            with contextlib.suppress(OSError):
                self._inotify.rm_watch(self._fd, wd)


# --------------------------------------------------------------------------- the table


class WatchTable:
    """Open watches by id, at most ``max_watches``; one unread for ``idle_secs`` is
    closed by the sweep each open and read runs."""

    def __init__(
        self,
        max_watches: int = MAX_WATCHES,
        idle_secs: float = IDLE_SECS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_watches = max_watches
        self._idle_secs = idle_secs
        self._clock = clock
        self._lock = threading.Lock()  # never held while a watch is read or walked
        self._by_id: dict[str, Watch] = {}

    def open(self, root: str, recursive: bool) -> str:
        self.sweep()
        with self._lock:
            self._check_room()
        watch = Watch(_inotify(), root, recursive)  # the walk, outside the table's lock
        watch_id = secrets.token_hex(8)
        try:
            with self._lock:
                self._check_room()  # another open may have taken the last place meanwhile
                watch.used_at = self._clock()
                self._by_id[watch_id] = watch
        except OSError:
            watch.shut()
            raise
        return watch_id

    def _check_room(self) -> None:
        if len(self._by_id) >= self._max_watches:
            raise OSError(errno.EMFILE, f"too many watches open (at most {self._max_watches})")

    def read(self, watch_id: str, max_events: int, wait_s: float) -> WatchReadAnswer:
        self.sweep()
        with self._lock:
            watch = self._by_id.get(watch_id)
        if watch is None:
            raise self._gone(watch_id)
        with watch.lock:  # two reads of one watch take turns; of two watches, not
            if watch.closed:
                raise self._gone(watch_id)
            watch.used_at = self._clock()
            try:
                answer = watch.read(max_events, wait_s)
            finally:
                watch.used_at = self._clock()
            if watch.closed:  # closed while this read waited
                raise self._gone(watch_id)
        return answer

    def _gone(self, watch_id: str) -> LookupError:
        return LookupError(
            f"no watch {watch_id!r} (closed, or expired after {self._idle_secs:g} s unread)"
        )

    def close(self, watch_id: str) -> bool:
        """Close the watch; False if none is open by this id."""
        with self._lock:
            watch = self._by_id.pop(watch_id, None)
        if watch is None:
            return False
        watch.shut()
        return True

    def sweep(self) -> int:
        """Close the watches unread longer than the limit; how many were closed."""
        now = self._clock()
        with self._lock:
            idle = [k for k, w in self._by_id.items() if now - w.used_at > self._idle_secs]
            watches = [self._by_id.pop(watch_id) for watch_id in idle]
        for watch in watches:
            watch.shut()
        return len(watches)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


WATCHES = WatchTable()


# --------------------------------------------------------------------------- ops


def _watch_id(req: dict[str, Any]) -> str:
    watch_id: str = params.require(req, "watch_id", str, "a string")
    return watch_id


def op_fs_watch_open(req: dict[str, Any]) -> wire.WatchIdAnswer:
    path = params.path(req)
    recursive = params.flag(req, "recursive")
    return {"watch_id": WATCHES.open(path, recursive)}


def op_fs_watch_read(req: dict[str, Any]) -> WatchReadAnswer:
    watch_id = _watch_id(req)
    wait_s = params.seconds_param(req, "wait_s", 0.0, MAX_WAIT_S)
    max_events = params.int_param(req, "max_events", 1, MAX_READ_EVENTS, DEFAULT_MAX_EVENTS)
    return WATCHES.read(watch_id, max_events, wait_s)


def op_fs_watch_close(req: dict[str, Any]) -> wire.WatchCloseAnswer:
    return {"closed": WATCHES.close(_watch_id(req))}


OPS: dict[str, Callable[[dict[str, Any]], Mapping[str, object]]] = {
    "fs_watch_open": op_fs_watch_open,
    "fs_watch_read": op_fs_watch_read,
    "fs_watch_close": op_fs_watch_close,
}
