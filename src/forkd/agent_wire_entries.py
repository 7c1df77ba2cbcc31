"""The guest agent's wire format for the filesystem ops E2B's envd needs: an entry
(``fs_stat``, ``fs_list`` to a depth, ``fs_mkdir``, ``fs_move``) and change
notifications (``fs_watch_open``, ``fs_watch_read``, ``fs_watch_close``).

The rest of the agent's ops are in :mod:`forkd.agent_wire`, whose :class:`Op` these
are; :data:`OPS` here are added to its. Shipped into the guest beside it. Standard
library only; no ``from __future__ import annotations`` (see agent_wire's docstring).
"""

from typing import Any, Literal, NotRequired, TypedDict

from forkd.agent_wire import Op

MAX_LIST_DEPTH = 32  # levels one fs_list walks down
MAX_FS_LIST_BYTES = 8 << 20  # of entries one fs_list answers (about; then truncated)
MAX_WATCH_WAIT_S = 30.0  # one fs_watch_read waits at most this long
MAX_WATCH_EVENTS = 10_000  # events one fs_watch_read answers


# --------------------------------------------------------------------------- entries


class EntryParams(TypedDict):
    path: str  # absolute, or relative to the user's home
    user: NotRequired[str]  # whose home, and who owns what fs_mkdir makes


class FsListParams(EntryParams):
    depth: int


class FsMoveParams(TypedDict):
    source: str
    destination: str
    user: NotRequired[str]


class FsEntry(TypedDict):
    name: str
    path: str
    type: str  # file, dir, symlink, other
    size: int
    mode: int  # permission bits
    permissions: str  # as ls shows them: -rw-r--r--
    owner: str
    group: str
    mtime: float
    symlink_target: NotRequired[str]


class FsListAnswer(TypedDict):
    entries: list[FsEntry]
    truncated: bool


class FsMkdirAnswer(TypedDict):
    created: bool
    entry: FsEntry


# --------------------------------------------------------------------------- watches


class WatchOpenParams(TypedDict):
    path: str
    recursive: bool


class WatchIdParams(TypedDict):
    watch_id: str


class WatchReadParams(WatchIdParams):
    wait_s: float
    max_events: int


class WatchIdAnswer(TypedDict):
    watch_id: str


EventKind = Literal["create", "write", "remove", "rename", "chmod"]


class WatchEvent(TypedDict):
    name: str  # relative to the watched directory ("" is the directory itself)
    type: EventKind


class WatchReadAnswer(TypedDict):
    events: list[WatchEvent]
    overflowed: bool  # events were lost since the last read


class WatchCloseAnswer(TypedDict):
    closed: bool


FS_STAT: Op[EntryParams, FsEntry] = Op("fs_stat", FsEntry)
FS_LIST: Op[FsListParams, FsListAnswer] = Op("fs_list", FsListAnswer)
FS_MKDIR: Op[EntryParams, FsMkdirAnswer] = Op("fs_mkdir", FsMkdirAnswer)
FS_MOVE: Op[FsMoveParams, FsEntry] = Op("fs_move", FsEntry)
WATCH_OPEN: Op[WatchOpenParams, WatchIdAnswer] = Op("fs_watch_open", WatchIdAnswer)
WATCH_READ: Op[WatchReadParams, WatchReadAnswer] = Op("fs_watch_read", WatchReadAnswer)
WATCH_CLOSE: Op[WatchIdParams, WatchCloseAnswer] = Op("fs_watch_close", WatchCloseAnswer)

# Every op above, by its name on the wire.
OPS: dict[str, Op[Any, Any]] = {op.name: op for op in globals().values() if isinstance(op, Op)}
