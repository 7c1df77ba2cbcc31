"""envd's ``process.Process`` service over Connect, as E2B's SDKs call it for
``commands.run``, ``commands.connect``, ``commands.kill``, stdin and ``pty``: each call
is the daemon's own process service's (:class:`ProcessService`), for the sandbox the
request's headers name (:mod:`.target`).

A command's stream starts with its pid, then its output as it comes (the guest's
output ring read one ``proc_read`` ahead, keep-alives while it is quiet), then its end.
A client that goes away leaves the command running, as envd does; ``Connect`` picks it
up again, from the output to come. Tags name commands for later calls; the daemon keeps
them (a sandbox's last :data:`MAX_TAGS`) for as long as it runs.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.method import MethodInfo
from connectrpc.server import Endpoint
from protobuf import Message, Oneof

from forkd.controller.e2b import process_messages as pm
from forkd.controller.e2b.connect_service import Ctx, SandboxRPC, ServiceApp, method
from forkd.controller.e2b.guest_values import UINT32_MAX, text
from forkd.controller.e2b.models import validated
from forkd.controller.e2b.per_sandbox import PerSandbox, still_there
from forkd.controller.e2b.rpc_errors import streamed, unary
from forkd.controller.models import (
    OutputData,
    OutputExit,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    ProcessStdin,
)
from forkd.controller.models import ProcessInfo as ForkdProcess
from forkd.controller.services import Services
from forkd.errors import GuestError, Invalid, NotFound

MAX_TAGS = 256  # a sandbox's tags the daemon holds; the oldest goes first
MAX_TAG_CHARS = 256
SIGNALS = {pm.Signal.SIGKILL: 9, pm.Signal.SIGTERM: 15}


class ProcessRPC(SandboxRPC):
    """The service; its tags, by sandbox."""

    def __init__(self, services: Callable[[], Services]) -> None:
        super().__init__(services)
        self._tags: PerSandbox[dict[str, int]] = PerSandbox(
            dict, lambda sid: still_there(services(), sid)
        )

    def _pid(self, sandbox_id: str, selector: pm.ProcessSelector | None) -> int:
        match selector.selector if selector else None:
            case Oneof(field="pid", value=pid):
                return int(pid)
            case Oneof(field="tag", value=tag):
                found = (self._tags.get(sandbox_id) or {}).get(str(tag))
                if found is None:
                    raise NotFound(f"no process is tagged {tag!r} in sandbox {sandbox_id!r}")
                return found
        raise Invalid("which process: give a pid or a tag")

    def _tag(self, sandbox_id: str, tag: str, pid: int) -> None:
        tags = self._tags.of(sandbox_id)
        tags.pop(tag, None)
        tags[tag] = pid
        while len(tags) > MAX_TAGS:
            del tags[next(iter(tags))]

    async def _running(self, svc: Services, sandbox_id: str, pid: int) -> ForkdProcess:
        info = await svc.processes.info(sandbox_id, pid)
        if not info.running:  # envd forgets a command once it ends
            raise NotFound(f"process {pid} is not running")
        return info

    @streamed
    async def start(self, req: pm.StartRequest, ctx: Ctx) -> AsyncIterator[pm.StartResponse]:
        svc, sandbox_id = self.sandbox(ctx)
        body = _start_body(req, self.user(ctx))
        if req.has_field("tag") and not 0 < len(req.tag) <= MAX_TAG_CHARS:
            raise Invalid(f"a tag is 1 to {MAX_TAG_CHARS} characters")
        info = await svc.processes.start(sandbox_id, body)
        if not 0 < info.pid <= UINT32_MAX:
            raise GuestError(f"the guest answered pid {info.pid}, which no process has")
        if req.has_field("tag"):
            self._tag(sandbox_id, req.tag, info.pid)
        yield pm.StartResponse(event=_started(info.pid))
        async for event in _events(svc, sandbox_id, info.pid, 0):
            yield pm.StartResponse(event=event)

    @streamed
    async def connect(self, req: pm.ConnectRequest, ctx: Ctx) -> AsyncIterator[pm.ConnectResponse]:
        svc, sandbox_id = self.sandbox(ctx)
        info = await self._running(svc, sandbox_id, self._pid(sandbox_id, req.process))
        yield pm.ConnectResponse(event=_started(info.pid))
        async for event in _events(svc, sandbox_id, info.pid, info.output_end):
            yield pm.ConnectResponse(event=event)

    @unary
    async def list(self, req: pm.ListRequest, ctx: Ctx) -> pm.ListResponse:
        svc, sandbox_id = self.sandbox(ctx)
        tag_of = {pid: tag for tag, pid in (self._tags.get(sandbox_id) or {}).items()}
        found = []
        for p in await svc.processes.list(sandbox_id):
            if p.running and p.cmd and 0 < p.pid <= UINT32_MAX:  # the guest's word
                config = pm.ProcessConfig(cmd=text(p.cmd[0]), args=[text(a) for a in p.cmd[1:]])
                info = pm.ProcessInfo(config=config, pid=p.pid)
                if p.pid in tag_of:
                    info.tag = tag_of[p.pid]
                found.append(info)
        return pm.ListResponse(processes=found)

    @unary
    async def send_input(self, req: pm.SendInputRequest, ctx: Ctx) -> pm.SendInputResponse:
        svc, sandbox_id = self.sandbox(ctx)
        await _write(svc, sandbox_id, self._pid(sandbox_id, req.process), req.input)
        return pm.SendInputResponse()

    @unary
    async def stream_input(
        self, reqs: AsyncIterator[pm.StreamInputRequest], ctx: Ctx
    ) -> pm.StreamInputResponse:
        svc, sandbox_id = self.sandbox(ctx)
        pid: int | None = None
        async for req in reqs:
            match req.event:
                case Oneof(field="start", value=pm.InputStart() as start):
                    pid = self._pid(sandbox_id, start.process)
                case Oneof(field="data", value=pm.InputData() as data):
                    if pid is None:
                        raise Invalid("input before the stream's start named a process")
                    await _write(svc, sandbox_id, pid, data.input)
        return pm.StreamInputResponse()

    @unary
    async def send_signal(self, req: pm.SendSignalRequest, ctx: Ctx) -> pm.SendSignalResponse:
        svc, sandbox_id = self.sandbox(ctx)
        number = SIGNALS.get(req.signal)
        if number is None:
            raise Invalid("signal: SIGNAL_SIGTERM or SIGNAL_SIGKILL")
        pid = (await self._running(svc, sandbox_id, self._pid(sandbox_id, req.process))).pid
        await svc.processes.signal(sandbox_id, pid, ProcessSignal(signal=number))
        return pm.SendSignalResponse()

    @unary
    async def close_stdin(self, req: pm.CloseStdinRequest, ctx: Ctx) -> pm.CloseStdinResponse:
        svc, sandbox_id = self.sandbox(ctx)
        pid = self._pid(sandbox_id, req.process)
        await svc.processes.write_stdin(sandbox_id, pid, ProcessStdin(eof=True))
        return pm.CloseStdinResponse()

    @unary
    async def update(self, req: pm.UpdateRequest, ctx: Ctx) -> pm.UpdateResponse:
        svc, sandbox_id = self.sandbox(ctx)
        pid = self._pid(sandbox_id, req.process)
        size = req.pty.size if req.pty else None
        if size is not None:
            resize = validated(ProcessResize, {"cols": size.cols, "rows": size.rows})
            await svc.processes.resize(sandbox_id, pid, resize)
        return pm.UpdateResponse()


def _start_body(req: pm.StartRequest, user: str | None) -> ProcessStart:
    config = req.process or pm.ProcessConfig()
    if not config.cmd:
        raise Invalid("process.cmd is empty")
    size = req.pty.size if req.pty else None
    fields: dict[str, Any] = {
        "cmd": [config.cmd, *config.args],
        "env": dict(config.envs) or None,
        "cwd": config.cwd if config.has_field("cwd") else None,
        "stdin": req.stdin if req.has_field("stdin") else False,
        "pty": {"cols": size.cols, "rows": size.rows} if size else None,
        "user": user,
    }
    return validated(ProcessStart, fields)


def _started(pid: int) -> pm.ProcessEvent:
    return pm.ProcessEvent(event=Oneof("start", pm.StartEvent(pid=pid)))


async def _events(
    svc: Services, sandbox_id: str, pid: int, offset: int
) -> AsyncIterator[pm.ProcessEvent]:
    """``pid``'s output from ``offset`` until it ends, as envd's events."""
    async for event in await svc.processes.output(sandbox_id, pid, offset, follow=True):
        body = event.body
        if event.event in ("stdout", "stderr", "pty") and isinstance(body, OutputData):
            output = pm.DataEvent(output=Oneof(event.event, body.raw()))
            yield pm.ProcessEvent(event=Oneof("data", output))
        elif event.event == "keepalive":
            yield pm.ProcessEvent(event=Oneof("keepalive", pm.KeepAlive()))
        elif event.event == "exit" and isinstance(body, OutputExit):
            yield pm.ProcessEvent(event=Oneof("end", _ended(body.exit_code)))
            return


def _ended(code: int | None) -> pm.EndEvent:
    if code is None:
        return pm.EndEvent(exited=False, status="ended, its exit code unknown")
    end = pm.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")
    if code != 0:
        end.error = end.status
    return end


async def _write(svc: Services, sandbox_id: str, pid: int, given: pm.ProcessInput | None) -> None:
    match given.input if given else None:
        case Oneof(field="stdin" | "pty", value=bytes() as data):
            stdin = ProcessStdin(data=base64.b64encode(data).decode(), encoding="base64")
            await svc.processes.write_stdin(sandbox_id, pid, stdin)
        case _:
            raise Invalid("input: stdin or pty bytes")


def _method(name: str, request: type[Message], response: type[Message]) -> MethodInfo[Any, Any]:
    return method("process.Process", name, request, response)


def _endpoints(svc: ProcessRPC) -> dict[str, Any]:
    at = "/process.Process/"
    return {
        at + "Start": Endpoint.server_stream(
            _method("Start", pm.StartRequest, pm.StartResponse), svc.start
        ),
        at + "Connect": Endpoint.server_stream(
            _method("Connect", pm.ConnectRequest, pm.ConnectResponse), svc.connect
        ),
        at + "List": Endpoint.unary(_method("List", pm.ListRequest, pm.ListResponse), svc.list),
        at + "SendInput": Endpoint.unary(
            _method("SendInput", pm.SendInputRequest, pm.SendInputResponse), svc.send_input
        ),
        at + "StreamInput": Endpoint.client_stream(
            _method("StreamInput", pm.StreamInputRequest, pm.StreamInputResponse),
            svc.stream_input,
        ),
        at + "SendSignal": Endpoint.unary(
            _method("SendSignal", pm.SendSignalRequest, pm.SendSignalResponse), svc.send_signal
        ),
        at + "CloseStdin": Endpoint.unary(
            _method("CloseStdin", pm.CloseStdinRequest, pm.CloseStdinResponse), svc.close_stdin
        ),
        at + "Update": Endpoint.unary(
            _method("Update", pm.UpdateRequest, pm.UpdateResponse), svc.update
        ),
    }


def process_app(services: Callable[[], Services], read_max_bytes: int) -> ServiceApp[ProcessRPC]:
    """The service as an ASGI app, served at ``/process.Process/<Method>``."""
    return ServiceApp(ProcessRPC(services), "/process.Process", _endpoints, read_max_bytes)
