"""Lifecycle events (``GET /v1/events``) as a method of :class:`~forkd.client.Controller`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from forkd.client.errors import ControllerError
from forkd.client.route_base import RouteBase

STREAM_READ_TIMEOUT_SECS = 60.0  # the daemon sends a keep-alive every 15 s of silence
RECONNECT_FIRST_WAIT_SECS = 0.2  # then doubled, up to RECONNECT_MAX_WAIT_SECS
RECONNECT_MAX_WAIT_SECS = 2.0


class Event(dict[str, Any]):
    """One lifecycle event: the JSON object the daemon sent (``id``, ``type``, ``time``,
    ``sandbox_id``, ``snapshot_tag`` and the type's own fields), with its common
    keys also as attributes. A ``gap`` says events were lost (``missed``, ``reason``)."""

    @property
    def id(self) -> int:
        return int(self["id"])

    @property
    def type(self) -> str:
        return str(self["type"])

    @property
    def time(self) -> str:
        return str(self["time"])

    @property
    def sandbox_id(self) -> str | None:
        return self.get("sandbox_id")

    @property
    def snapshot_tag(self) -> str | None:
        return self.get("snapshot_tag")


def event_params(types: Iterable[str] | str | None, sandbox_id: str | None) -> dict[str, Any]:
    """The query of ``/v1/events`` for these filters (both clients)."""
    params: dict[str, Any] = {}
    if types is not None:
        params["type"] = types if isinstance(types, str) else ",".join(types)
    if sandbox_id is not None:
        params["sandbox_id"] = sandbox_id
    return params


def stream_request(params: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The keywords of one connection to ``/v1/events`` (resuming after ``since``)."""
    headers = {"Accept": "text/event-stream"}
    if "since" in params:
        headers["Last-Event-ID"] = str(params["since"])
    return {
        "params": params,
        "headers": headers,
        "timeout": httpx.Timeout(timeout, read=max(timeout, STREAM_READ_TIMEOUT_SECS)),
    }


def parse(sse: ServerSentEvent) -> tuple[int, Event | None] | None:
    """An event and its id; ``(id, None)`` for an id alone; None for no id (a keep-alive)."""
    if not sse.id:
        return None
    return int(sse.id), Event(json.loads(sse.data)) if sse.data else None


def next_wait(wait: float) -> float:
    """The pause before the next reconnection: doubled, up to RECONNECT_MAX_WAIT_SECS."""
    return min(wait * 2, RECONNECT_MAX_WAIT_SECS)


class EventRoutes(RouteBase):
    """Mixed into Controller: ``/v1/events``."""

    _client: httpx.Client

    def events(
        self,
        types: Iterable[str] | str | None = None,
        sandbox_id: str | None = None,
        since: int | None = None,
        reconnect_s: float = 30.0,
        on_position: Callable[[int], None] | None = None,
    ) -> Iterator[Event]:
        """``GET /v1/events``: lifecycle events as they happen, without end.

        ``types`` (e.g. ``["created", "killed"]``) and ``sandbox_id`` filter;
        ``since`` replays the events after that id the daemon still holds
        (0: all it holds). A dropped connection is made again, from the last
        id seen (``Last-Event-ID``), so nothing is missed or repeated; events
        the daemon no longer held come as one ``gap`` event. Trying to connect
        for ``reconnect_s`` without success raises :class:`ControllerError`
        (status 0); an answer other than 200 raises it at once. ``on_position`` hears
        the id each connection starts after, once the daemon follows for it.

        Example::

            for ev in ctl.events(types=["created", "killed"]):
                print(ev.time, ev.type, ev.sandbox_id)
        """
        params = event_params(types, sandbox_id)
        position = since
        failing_since: float | None = None
        wait = RECONNECT_FIRST_WAIT_SECS
        while True:
            if position is not None:
                params["since"] = position
            try:
                for event_id, event in self._event_stream(params):
                    failing_since, wait = None, RECONNECT_FIRST_WAIT_SECS  # it answers
                    position = event_id
                    if event is not None:
                        yield event
                    elif on_position is not None:  # the stream's place: it is following
                        on_position(event_id)
            except httpx.TransportError as exc:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= reconnect_s:
                    raise ControllerError(
                        0, f"the event stream of the forkd daemon at {self.url} failed: {exc!r}"
                    ) from exc
            time.sleep(wait)  # ended (the daemon restarts) or failed: connect again
            wait = next_wait(wait)

    def _event_stream(self, params: dict[str, Any]) -> Iterator[tuple[int, Event | None]]:
        """One connection's events, each with its id; ``None`` for an id alone."""
        with self._client.stream(
            "GET", "/v1/events", **stream_request(params, self.timeout)
        ) as resp:
            if not resp.is_success:
                resp.read()
                raise ControllerError.from_response(resp)
            for sse in EventSource(resp).iter_sse():
                parsed = parse(sse)
                if parsed is not None:
                    yield parsed
