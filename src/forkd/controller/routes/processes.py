"""A sandbox's background processes and their output streams."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.responses import StreamingResponse

from forkd.controller import sse
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models import (
    ProcessInfo,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    ProcessStdin,
    StdinWritten,
)
from forkd.controller.routes.common import NO_CONTENT, Svc

Pid = Annotated[int, Path(ge=1, description="the process id in the guest")]


EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": {"type": "string"}}},
    "description": "Server-Sent Events: stdout, stderr, pty ({data, encoding, offset, "
    "next_offset}), gap ({from, to}), exit ({exit_code}, last), error ({error}, last)",
}


processes = APIRouter(
    prefix="/v1/sandboxes/{sandbox_id}/processes", tags=["processes"], responses=ERROR_RESPONSES
)


@processes.post("", status_code=201, response_model=ProcessInfo)
async def start_process(svc: Svc, sandbox_id: str, body: ProcessStart) -> ProcessInfo:
    return await svc.processes.start(sandbox_id, body)


@processes.get("", response_model=list[ProcessInfo])
async def list_processes(svc: Svc, sandbox_id: str) -> list[ProcessInfo]:
    return await svc.processes.list(sandbox_id)


@processes.get("/{pid}", response_model=ProcessInfo)
async def process_info(svc: Svc, sandbox_id: str, pid: Pid) -> ProcessInfo:
    return await svc.processes.info(sandbox_id, pid)


@processes.get("/{pid}/output", response_class=StreamingResponse, responses={200: EVENTS})
async def process_output(
    svc: Svc,
    sandbox_id: str,
    pid: Pid,
    follow: bool = True,
    offset: Annotated[int | None, Query(ge=0, description="default: Last-Event-ID, else 0")] = None,
    last_event_id: Annotated[int | None, Header(ge=0)] = None,
) -> StreamingResponse:
    """The process's output from ``offset``; with ``follow``, until it exits."""
    start = offset if offset is not None else last_event_id or 0
    events = await svc.processes.output(sandbox_id, pid, start, follow)
    return StreamingResponse(sse.framed(events), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


@processes.post("/{pid}/stdin", response_model=StdinWritten)
async def process_stdin(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessStdin) -> StdinWritten:
    return await svc.processes.write_stdin(sandbox_id, pid, body)


@processes.post("/{pid}/signal", **NO_CONTENT)
async def signal_process(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessSignal) -> Response:
    await svc.processes.signal(sandbox_id, pid, body)
    return Response(status_code=204)


@processes.post("/{pid}/resize", **NO_CONTENT)
async def resize_process(svc: Svc, sandbox_id: str, pid: Pid, body: ProcessResize) -> Response:
    await svc.processes.resize(sandbox_id, pid, body)
    return Response(status_code=204)
