"""envd's ``filesystem.Filesystem`` service over Connect, as E2B's SDKs call it for
``files.exists``, ``get_info``, ``list``, ``make_dir``, ``rename``, ``remove`` and
``watch_dir``: each call is the sandbox's guest agent's entry and watch ops (the guest's
own stat, listing, mkdir, rename, and its kernel's inotify), for the sandbox the
request's headers name.

A relative path is the user's home's, as envd resolves one. A watch streams the guest's
change notifications (``WatchDir``, a keep-alive while quiet) or keeps them for polling
(``CreateWatcher``, then ``GetWatcherEvents``); a watcher is the guest's, so it lives
in the sandbox's memory: forks and branches carry it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.server import Endpoint
from protobuf import Message, Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from forkd import agent_wire_entries as wire
from forkd.controller.e2b import filesystem_messages as fm
from forkd.controller.e2b.connect_service import Ctx, SandboxRPC, ServiceApp, method
from forkd.controller.e2b.guest_values import INT64_MAX, UINT32_MAX, clamped, text, unix_time
from forkd.controller.e2b.rpc_errors import streamed, unary
from forkd.controller.services import Services
from forkd.errors import ForkdError, Invalid, NotFound

WATCH_WAIT_SECS = 15.0  # one read of a streamed watch waits this long; then a keep-alive
PAUSED_POLL_SECS = 0.25
# The guest's refusals of these ops, beyond the common table: an unknown watch.
REFUSALS = {"LookupError": NotFound}
TYPES = {
    "file": fm.FileType.FILE,
    "dir": fm.FileType.DIRECTORY,
    "symlink": fm.FileType.SYMLINK,
}
EVENTS = {
    "create": fm.EventType.CREATE,
    "write": fm.EventType.WRITE,
    "remove": fm.EventType.REMOVE,
    "rename": fm.EventType.RENAME,
    "chmod": fm.EventType.CHMOD,
}


def entry_info(entry: wire.FsEntry) -> fm.EntryInfo:
    """An entry as envd describes it (a type it has no name for: unspecified, which the
    SDKs leave out of a listing); the guest's values kept to what the message holds."""
    mtime = unix_time(entry["mtime"])
    seconds = int(mtime)
    info = fm.EntryInfo(
        name=text(entry["name"]),
        type=TYPES.get(entry["type"], fm.FileType.UNSPECIFIED),
        path=text(entry["path"]),
        size=clamped(entry["size"], 0, INT64_MAX),
        mode=clamped(entry["mode"], 0, UINT32_MAX),
        permissions=text(entry["permissions"]),
        owner=text(entry["owner"]),
        group=text(entry["group"]),
        modified_time=Timestamp(seconds=seconds, nanos=int((mtime - seconds) * 1e9)),
        is_symlink=entry["type"] == "symlink",
    )
    if "symlink_target" in entry:
        info.symlink_target = text(entry["symlink_target"])
    return info


class FilesystemRPC(SandboxRPC):
    async def _stat(self, svc: Services, sandbox_id: str, path: str, ctx: Ctx) -> wire.FsEntry:
        user = self.user(ctx)
        return await svc.guest.call(sandbox_id, lambda vm: vm.guest.fs_stat(path, user), REFUSALS)

    @unary
    async def stat(self, req: fm.StatRequest, ctx: Ctx) -> fm.StatResponse:
        svc, sandbox_id = self.sandbox(ctx)
        return fm.StatResponse(entry=entry_info(await self._stat(svc, sandbox_id, req.path, ctx)))

    @unary
    async def list_dir(self, req: fm.ListDirRequest, ctx: Ctx) -> fm.ListDirResponse:
        svc, sandbox_id = self.sandbox(ctx)
        depth, user = req.depth or 1, self.user(ctx)
        if depth > wire.MAX_LIST_DEPTH:
            raise Invalid(f"depth is at most {wire.MAX_LIST_DEPTH}")
        listed = await svc.guest.call(
            sandbox_id, lambda vm: vm.guest.fs_list(req.path, depth, user), REFUSALS
        )
        return fm.ListDirResponse(entries=[entry_info(e) for e in listed["entries"]])

    @unary
    async def make_dir(self, req: fm.MakeDirRequest, ctx: Ctx) -> fm.MakeDirResponse:
        svc, sandbox_id = self.sandbox(ctx)
        user = self.user(ctx)
        made = await svc.guest.call(
            sandbox_id, lambda vm: vm.guest.fs_mkdir(req.path, user), REFUSALS
        )
        if not made["created"]:  # E2B's SDKs answer False for this one
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {req.path!r} already exists")
        return fm.MakeDirResponse(entry=entry_info(made["entry"]))

    @unary
    async def move(self, req: fm.MoveRequest, ctx: Ctx) -> fm.MoveResponse:
        svc, sandbox_id = self.sandbox(ctx)
        user = self.user(ctx)
        moved = await svc.guest.call(
            sandbox_id,
            lambda vm: vm.guest.fs_move(req.source, req.destination, user),
            REFUSALS,
        )
        return fm.MoveResponse(entry=entry_info(moved))

    @unary
    async def remove(self, req: fm.RemoveRequest, ctx: Ctx) -> fm.RemoveResponse:
        svc, sandbox_id = self.sandbox(ctx)
        path = (await self._stat(svc, sandbox_id, req.path, ctx))["path"]  # made absolute
        await svc.guest.call(sandbox_id, lambda vm: vm.guest.remove(path, recursive=True))
        return fm.RemoveResponse()

    async def _open(
        self, svc: Services, sandbox_id: str, req: fm.WatchRequest, ctx: Ctx
    ) -> tuple[str, str]:
        """A watch of the guest's for ``req``: its id, and the directory's absolute path."""
        root = await self._stat(svc, sandbox_id, req.path, ctx)
        if root["type"] != "dir":
            raise Invalid(f"{req.path!r} is not a directory")
        path, recursive = root["path"], req.recursive
        watch_id = await svc.guest.call(
            sandbox_id, lambda vm: vm.guest.watch_open(path, recursive), REFUSALS
        )
        return watch_id, path

    @streamed
    async def watch_dir(
        self, req: fm.WatchDirRequest, ctx: Ctx
    ) -> AsyncIterator[fm.WatchDirResponse]:
        svc, sandbox_id = self.sandbox(ctx)
        watch_id, root = await self._open(svc, sandbox_id, req, ctx)
        try:
            yield fm.WatchDirResponse(event=Oneof("start", fm.WatchStart()))
            while True:
                answer = await _read_awake(svc, sandbox_id, watch_id)
                if answer is None or not answer["events"]:
                    yield fm.WatchDirResponse(event=Oneof("keepalive", fm.WatchKeepAlive()))
                    continue
                for event in await self._events(svc, sandbox_id, answer, root, req, ctx):
                    yield fm.WatchDirResponse(event=Oneof("filesystem", event))
        finally:
            await _close_soon(svc, sandbox_id, watch_id)

    async def _events(
        self,
        svc: Services,
        sandbox_id: str,
        answer: wire.WatchReadAnswer,
        root: str,
        req: fm.WatchRequest,
        ctx: Ctx,
    ) -> list[fm.FilesystemEvent]:
        found = []
        for event in answer["events"]:
            made = fm.FilesystemEvent(name=text(event["name"]), type=EVENTS[event["type"]])
            if req.include_entry and event["type"] in ("create", "write", "chmod"):
                with contextlib.suppress(ForkdError):  # gone again since
                    path = f"{root.rstrip('/')}/{event['name']}" if event["name"] else root
                    made.entry = entry_info(await self._stat(svc, sandbox_id, path, ctx))
            found.append(made)
        return found

    @unary
    async def create_watcher(
        self, req: fm.CreateWatcherRequest, ctx: Ctx
    ) -> fm.CreateWatcherResponse:
        svc, sandbox_id = self.sandbox(ctx)
        watch_id, _ = await self._open(svc, sandbox_id, req, ctx)
        return fm.CreateWatcherResponse(watcher_id=watch_id)

    @unary
    async def get_watcher_events(
        self, req: fm.GetWatcherEventsRequest, ctx: Ctx
    ) -> fm.GetWatcherEventsResponse:
        svc, sandbox_id = self.sandbox(ctx)
        answer = await svc.guest.call(
            sandbox_id, lambda vm: vm.guest.watch_read(req.watcher_id, 0.0), REFUSALS
        )
        events = [
            fm.FilesystemEvent(name=text(e["name"]), type=EVENTS[e["type"]])
            for e in answer["events"]
        ]
        return fm.GetWatcherEventsResponse(events=events)

    @unary
    async def remove_watcher(
        self, req: fm.RemoveWatcherRequest, ctx: Ctx
    ) -> fm.RemoveWatcherResponse:
        svc, sandbox_id = self.sandbox(ctx)
        closed = await svc.guest.call(sandbox_id, lambda vm: vm.guest.watch_close(req.watcher_id))
        if not closed:
            raise NotFound(f"no watcher {req.watcher_id!r}")
        return fm.RemoveWatcherResponse()


async def _read_awake(svc: Services, sandbox_id: str, watch_id: str) -> wire.WatchReadAnswer | None:
    """The watch's next events, waiting for some; None when the sandbox is paused (its
    stream does not wake it: the watch goes on where it was once someone resumes it)."""
    if svc.processes.asleep(sandbox_id):
        await asyncio.sleep(PAUSED_POLL_SECS)
        return None
    try:
        return await svc.guest.call(
            sandbox_id,
            lambda vm: vm.guest.watch_read(watch_id, WATCH_WAIT_SECS),
            REFUSALS,
            wake=False,
        )
    except ForkdError:
        if svc.processes.asleep(sandbox_id):
            return None
        raise


async def _close_soon(svc: Services, sandbox_id: str, watch_id: str) -> None:
    """Close the guest's watch, whether or not the stream's task is being cancelled."""

    async def close() -> None:
        with contextlib.suppress(ForkdError):
            await svc.guest.call(sandbox_id, lambda vm: vm.guest.watch_close(watch_id), wake=False)

    task = asyncio.ensure_future(close())
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.shield(task)


def _method(name: str, request: type[Message], response: type[Message]) -> Any:
    return method("filesystem.Filesystem", name, request, response)


def _endpoints(svc: FilesystemRPC) -> dict[str, Any]:
    at = "/filesystem.Filesystem/"
    unaries: list[tuple[str, type[Message], type[Message], Callable[[Any, Ctx], Any]]] = [
        ("Stat", fm.StatRequest, fm.StatResponse, svc.stat),
        ("MakeDir", fm.MakeDirRequest, fm.MakeDirResponse, svc.make_dir),
        ("Move", fm.MoveRequest, fm.MoveResponse, svc.move),
        ("ListDir", fm.ListDirRequest, fm.ListDirResponse, svc.list_dir),
        ("Remove", fm.RemoveRequest, fm.RemoveResponse, svc.remove),
        ("CreateWatcher", fm.CreateWatcherRequest, fm.CreateWatcherResponse, svc.create_watcher),
        (
            "GetWatcherEvents",
            fm.GetWatcherEventsRequest,
            fm.GetWatcherEventsResponse,
            svc.get_watcher_events,
        ),
        ("RemoveWatcher", fm.RemoveWatcherRequest, fm.RemoveWatcherResponse, svc.remove_watcher),
    ]
    found: dict[str, Any] = {
        at + name: Endpoint.unary(_method(name, req, res), fn) for name, req, res, fn in unaries
    }
    watch = _method("WatchDir", fm.WatchDirRequest, fm.WatchDirResponse)
    found[at + "WatchDir"] = Endpoint.server_stream(watch, svc.watch_dir)
    return found


def filesystem_app(
    services: Callable[[], Services], read_max_bytes: int
) -> ServiceApp[FilesystemRPC]:
    """The service as an ASGI app, served at ``/filesystem.Filesystem/<Method>``."""
    return ServiceApp(FilesystemRPC(services), "/filesystem.Filesystem", _endpoints, read_max_bytes)
