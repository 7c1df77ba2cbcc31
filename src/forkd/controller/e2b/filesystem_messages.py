"""The messages of envd's ``filesystem.Filesystem`` service, as E2B's SDKs encode them
(package ``filesystem``, file ``filesystem/filesystem.proto``): forkd's own definitions
of that wire format (:mod:`.proto_schema`), field for field the same numbers, types and
names. An entry is a file, directory or symlink with its stat; a watch streams
(or, polled, hands back) the changes under a directory.
"""

from __future__ import annotations

from typing import Literal

from protobuf import DescFile, Enum, Message, Oneof
from protobuf.wkt.google.protobuf import timestamp_pb
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from forkd.controller.e2b.proto_schema import EnumDef, Field, Msg, ProtoFile, build


class FileType(Enum):
    UNSPECIFIED = 0
    FILE = 1
    DIRECTORY = 2
    SYMLINK = 3


class EventType(Enum):
    UNSPECIFIED = 0
    CREATE = 1
    WRITE = 2
    REMOVE = 3
    RENAME = 4
    CHMOD = 5


class EntryInfo(Message):
    __slots__ = (
        "group",
        "is_symlink",
        "metadata",
        "mode",
        "modified_time",
        "name",
        "owner",
        "path",
        "permissions",
        "size",
        "symlink_target",
        "type",
    )
    name: str
    type: FileType
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: Timestamp | None
    symlink_target: str
    metadata: dict[str, str]
    is_symlink: bool


class PathRequest(Message):
    """Stat, MakeDir and Remove: one path."""

    __slots__ = ("path",)
    path: str


class StatRequest(PathRequest):
    __slots__ = ()


class MakeDirRequest(PathRequest):
    __slots__ = ()


class RemoveRequest(PathRequest):
    __slots__ = ()


class EntryResponse(Message):
    """Stat, MakeDir and Move: the entry."""

    __slots__ = ("entry",)
    entry: EntryInfo | None


class StatResponse(EntryResponse):
    __slots__ = ()


class MakeDirResponse(EntryResponse):
    __slots__ = ()


class MoveResponse(EntryResponse):
    __slots__ = ()


class RemoveResponse(Message):
    __slots__ = ()


class MoveRequest(Message):
    __slots__ = ("destination", "source")
    source: str
    destination: str


class ListDirRequest(Message):
    __slots__ = ("depth", "path")
    path: str
    depth: int


class ListDirResponse(Message):
    __slots__ = ("entries",)
    entries: list[EntryInfo]


class WatchRequest(Message):
    """WatchDir and CreateWatcher: what to watch."""

    __slots__ = ("allow_network_mounts", "include_entry", "path", "recursive")
    path: str
    recursive: bool
    include_entry: bool
    allow_network_mounts: bool


class WatchDirRequest(WatchRequest):
    __slots__ = ()


class CreateWatcherRequest(WatchRequest):
    __slots__ = ()


class FilesystemEvent(Message):
    __slots__ = ("entry", "name", "type")
    name: str
    type: EventType
    entry: EntryInfo | None


class WatchStart(Message):
    __slots__ = ()


class WatchKeepAlive(Message):
    __slots__ = ()


class WatchDirResponse(Message):
    __slots__ = ("event",)
    event: (
        Oneof[Literal["start"], WatchStart]
        | Oneof[Literal["filesystem"], FilesystemEvent]
        | Oneof[Literal["keepalive"], WatchKeepAlive]
        | None
    )


class WatcherId(Message):
    """CreateWatcher's answer, GetWatcherEvents' and RemoveWatcher's request."""

    __slots__ = ("watcher_id",)
    watcher_id: str


class CreateWatcherResponse(WatcherId):
    __slots__ = ()


class GetWatcherEventsRequest(WatcherId):
    __slots__ = ()


class RemoveWatcherRequest(WatcherId):
    __slots__ = ()


class GetWatcherEventsResponse(Message):
    __slots__ = ("events",)
    events: list[FilesystemEvent]


class RemoveWatcherResponse(Message):
    __slots__ = ()


_PATH = (Field("path", 1, "string"),)
_ENTRY = (Field("entry", 1, ".filesystem.EntryInfo"),)
_WATCH = (
    Field("path", 1, "string"),
    Field("recursive", 2, "bool"),
    Field("include_entry", 3, "bool"),
    Field("allow_network_mounts", 4, "bool"),
)
_WATCHER = (Field("watcher_id", 1, "string"),)

FILE = ProtoFile(
    path="filesystem/filesystem.proto",
    package="filesystem",
    imports=(timestamp_pb.desc(),),
    messages=(
        Msg(
            "MoveRequest",
            MoveRequest,
            (Field("source", 1, "string"), Field("destination", 2, "string")),
        ),
        Msg("MoveResponse", MoveResponse, _ENTRY),
        Msg("MakeDirRequest", MakeDirRequest, _PATH),
        Msg("MakeDirResponse", MakeDirResponse, _ENTRY),
        Msg("RemoveRequest", RemoveRequest, _PATH),
        Msg("RemoveResponse", RemoveResponse),
        Msg("StatRequest", StatRequest, _PATH),
        Msg("StatResponse", StatResponse, _ENTRY),
        Msg(
            "EntryInfo",
            EntryInfo,
            (
                Field("name", 1, "string"),
                Field("type", 2, ".filesystem.FileType"),
                Field("path", 3, "string"),
                Field("size", 4, "int64"),
                Field("mode", 5, "uint32"),
                Field("permissions", 6, "string"),
                Field("owner", 7, "string"),
                Field("group", 8, "string"),
                Field("modified_time", 9, ".google.protobuf.Timestamp"),
                Field("symlink_target", 10, "string", optional=True),
                Field("metadata", 11, "", map_value="string"),
                Field("is_symlink", 12, "bool"),
            ),
        ),
        Msg(
            "ListDirRequest",
            ListDirRequest,
            (Field("path", 1, "string"), Field("depth", 2, "uint32")),
        ),
        Msg(
            "ListDirResponse",
            ListDirResponse,
            (Field("entries", 1, ".filesystem.EntryInfo", repeated=True),),
        ),
        Msg("WatchDirRequest", WatchDirRequest, _WATCH),
        Msg(
            "FilesystemEvent",
            FilesystemEvent,
            (
                Field("name", 1, "string"),
                Field("type", 2, ".filesystem.EventType"),
                Field("entry", 3, ".filesystem.EntryInfo", optional=True),
            ),
        ),
        Msg(
            "WatchDirResponse",
            WatchDirResponse,
            (
                Field("start", 1, ".filesystem.WatchDirResponse.StartEvent", oneof="event"),
                Field("filesystem", 2, ".filesystem.FilesystemEvent", oneof="event"),
                Field("keepalive", 3, ".filesystem.WatchDirResponse.KeepAlive", oneof="event"),
            ),
            nested=(Msg("StartEvent", WatchStart), Msg("KeepAlive", WatchKeepAlive)),
        ),
        Msg("CreateWatcherRequest", CreateWatcherRequest, _WATCH),
        Msg("CreateWatcherResponse", CreateWatcherResponse, _WATCHER),
        Msg("GetWatcherEventsRequest", GetWatcherEventsRequest, _WATCHER),
        Msg(
            "GetWatcherEventsResponse",
            GetWatcherEventsResponse,
            (Field("events", 1, ".filesystem.FilesystemEvent", repeated=True),),
        ),
        Msg("RemoveWatcherRequest", RemoveWatcherRequest, _WATCHER),
        Msg("RemoveWatcherResponse", RemoveWatcherResponse),
    ),
    enums=(
        EnumDef(
            "FileType",
            FileType,
            tuple((f"FILE_TYPE_{m.name}", m.value) for m in FileType),
        ),
        EnumDef(
            "EventType",
            EventType,
            tuple((f"EVENT_TYPE_{m.name}", m.value) for m in EventType),
        ),
    ),
)

DESC: DescFile = build(FILE)
