"""Lifecycle events as Server-Sent Events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from forkd.controller import sse
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.routes.common import Svc, only_named

events = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)


SSE_EVENT = {  # each event of the stream, as a client's SSE parser gives it
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "id": {"type": "string"},
        "data": {"type": "string", "description": "a JSON object"},
    },
}


LIFECYCLE_EVENTS = {
    "content": {sse.MEDIA_TYPE: {"schema": SSE_EVENT}},
    "description": "Server-Sent Events, one per lifecycle event (docs/API.md, Events): event "
    "(its type), id, data ({id, type, time, sandbox_id?, snapshot_tag?, ...}); a gap "
    "({after, missed, reason}) when events it would have had were lost",
}


SINCE = "replay after this id (0: all kept); default: Last-Event-ID, else from now"


@events.get("", response_class=StreamingResponse, responses={200: LIFECYCLE_EVENTS})
async def lifecycle_events(
    svc: Svc,
    request: Request,
    type: Annotated[str | None, Query(description="event types, comma-separated")] = None,
    sandbox_id: Annotated[str | None, Query(description="this sandbox's events only")] = None,
    since: Annotated[int | None, Query(ge=0, description=SINCE)] = None,
    last_event_id: Annotated[int | None, Header(ge=0)] = None,
) -> StreamingResponse:
    """Lifecycle events as they happen, until the daemon stops."""
    only_named(request, "type", "sandbox_id", "since")
    types = None if type is None else type.split(",")
    start = since if since is not None else last_event_id
    stream = svc.events.subscribe(types, sandbox_id, start)
    return StreamingResponse(sse.lifecycle(stream), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
