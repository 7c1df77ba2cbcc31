"""Server-Sent Events: output and lifecycle event streams as ``text/event-stream`` bytes.

Each event is ``event:`` (its kind), ``id:`` (the output offset after it, so
a client's ``Last-Event-ID`` is where it resumes) and one ``data:`` line of
JSON. A keep-alive is a comment line, which clients ignore. A failure after
the first event ends the stream with an ``error`` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from forkd.controller.http_errors import status_of
from forkd.controller.models import OutputEvent, StreamError
from forkd.controller.services.events import Event
from forkd.errors import ForkdError

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer it
KEEPALIVE = b": keepalive\n\n"


def frame(event: OutputEvent) -> bytes:
    if event.body is None:
        return KEEPALIVE
    lines = [f"event: {event.event}"]
    if event.next_offset is not None:
        lines.append(f"id: {event.next_offset}")
    lines.append("data: " + event.body.model_dump_json(by_alias=True))
    return ("\n".join(lines) + "\n\n").encode()


async def framed(events: AsyncIterator[OutputEvent]) -> AsyncIterator[bytes]:
    """The events as bytes; a failure after the status line went out is a last
    ``error`` event carrying the status it would have had."""
    try:
        async for event in events:
            yield frame(event)
    except ForkdError as exc:
        yield frame(OutputEvent("error", StreamError(error=str(exc), status=status_of(exc))))


async def lifecycle(events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    """Lifecycle events (:mod:`forkd.controller.services.events`) as bytes; ``None``
    is a keep-alive, and an event without a type only an ``id:`` (a client's
    ``Last-Event-ID`` from then on, no event)."""
    async for event in events:
        if event is None:
            yield KEEPALIVE
        elif not event.type:
            yield f"id: {event.id}\n\n".encode()
        else:
            yield f"event: {event.type}\nid: {event.id}\ndata: {event.data}\n\n".encode()
