"""The daemon's lifecycle events: a bounded ring of the recent ones, and the streams that follow it.

**Publishing.** Every service reaches the one bus as ``self.events``::

    self.events.publish("paused", sandbox_id=sid, pause_ms=12.5)
    self.events.publish("snapshot_created", snapshot_tag=tag, kind="template")

``publish(type, *, sandbox_id=None, snapshot_tag=None, **fields)`` never raises
and never blocks: it stamps the event with the next id and the time, encodes
it as JSON once (a field that JSON cannot hold is sent as its ``str``),
appends it to the ring and wakes the streams. Call it once the change is done
and stored, so a client that reads the sandbox on the event sees the new
state; from the event loop's thread or any other. ``type`` is one of
:data:`EVENT_TYPES` (a new kind is added there and in docs/API.md); the
fields each type carries are listed in docs/API.md, "Events".

**Following.** :meth:`EventBus.subscribe` (the ``GET /v1/events`` route) gives
the events after an id as they come, filtered on type and sandbox. A stream
holds only its place in the ring, no queue of its own, so one that reads
slowly or not at all costs the daemon nothing as events are published. When
the ring has moved past its place (it fell more than :data:`EVENT_RING_SIZE`
events behind, or it asks for ids of an earlier run of the daemon) its next
event is a ``gap``, and it goes on from the oldest event the ring holds:
events are never skipped silently. Event ids are integers that increase,
also across restarts of the daemon (the first is the start time in
microseconds), so an id from an earlier run is older than every id held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from forkd.errors import Invalid, OverCapacity, Unavailable
from forkd.limits import EVENT_HEARTBEAT_SECS, EVENT_RING_SIZE, MAX_EVENT_SUBSCRIBERS

log = logging.getLogger(__name__)

EVENT_TYPES = (
    "created",  # a sandbox was forked and runs
    "paused",
    "resumed",
    "hibernated",
    "branched",  # a sandbox was branched into a snapshot (snapshot_tag, pause_ms)
    "expired",  # a sandbox reached its timeout (action); what the action did follows
    "killed",  # the daemon stopped a sandbox's VM (DELETE, a timeout, a broken VM)
    "died",  # a sandbox's QEMU exited on its own
    "snapshot_progress",  # a template's build goes on: step, message, the service's output
    "snapshot_created",
    "snapshot_deleted",
    "explore_variant",  # a variant of an explore finished (on the source: explore, index, ...)
    "egress",  # the egress proxy let out or refused a connection or an HTTP request
    "network_changed",  # a sandbox's network policy was replaced at runtime
    "explored",  # an explore ended (on the source: explore, kept, best)
    "webhook_failed",  # a webhook's delivery was given up (webhook_id, msg_id, error)
    "stop_hook",  # a sandbox's stop hook ran before it was stopped (reason, exit_code, output)
    "wake_failed",  # a hibernated sandbox could not be woken; it stays hibernated (reason)
)
GAP = "gap"  # not published: what a stream gets when events it would have had are lost
POSITION = ""  # not published: a stream's first item, its place (the id it follows)
BATCH = 100  # events a stream takes from the ring at a time


@dataclass(frozen=True)
class Event:
    """One event: ``data`` is its JSON object, encoded once for every stream."""

    id: int
    type: str
    sandbox_id: str | None
    data: str


def utc_stamp(unix: float | None = None) -> str:
    """``unix`` (default: now) as an event's ``time``: ISO 8601, UTC, to the millisecond,
    with ``Z``."""
    moment = time.time() if unix is None else unix
    stamp = datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _encode(body: dict[str, Any]) -> str:
    return json.dumps(body, default=str, separators=(",", ":"))


class _Stream:
    """One subscriber: how to wake it from any thread."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()

    def notify(self) -> None:
        if threading.get_ident() == self.thread:
            self.wake.set()
        else:
            self.loop.call_soon_threadsafe(self.wake.set)


class EventBus:
    def __init__(
        self,
        ring_size: int = EVENT_RING_SIZE,
        max_subscribers: int = MAX_EVENT_SUBSCRIBERS,
        heartbeat_s: float = EVENT_HEARTBEAT_SECS,
    ) -> None:
        self.max_subscribers = max_subscribers
        self.heartbeat_s = heartbeat_s
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._first_id = time.time_ns() // 1000  # ids of an earlier run are smaller
        self._next_id = self._first_id
        self._lock = threading.Lock()  # publish may come from a worker thread
        # Taken before _lock: the store's, once guard() is given it.
        self._outer: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self._streams: weakref.WeakSet[_Stream] = weakref.WeakSet()
        self._closed = False
        # Told each event as it is published, on the publisher's thread (the webhooks'
        # outbox): quick, and what one raises is logged, never the publisher's.
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    @property
    def last_id(self) -> int:
        """The id of the last event published (one less than the first, before any)."""
        return self._next_id - 1

    def publish(
        self,
        type: str,
        *,
        sandbox_id: str | None = None,
        snapshot_tag: str | None = None,
        **fields: Any,
    ) -> None:
        """Record an event and wake the streams; never raises, never blocks."""
        try:
            if type not in EVENT_TYPES:
                log.error("event type %r is not in EVENT_TYPES; published anyway", type)
            with self._outer, self._lock:
                event_id = self._next_id
                self._next_id += 1
                body: dict[str, Any] = {"id": event_id, "type": type, "time": utc_stamp()}
                if sandbox_id is not None:
                    body["sandbox_id"] = sandbox_id
                if snapshot_tag is not None:
                    body["snapshot_tag"] = snapshot_tag
                body.update((k, v) for k, v in fields.items() if k not in body)
                self._ring.append(Event(event_id, type, sandbox_id, _encode(body)))
                streams = list(self._streams)
                for listener in self._listeners:  # under the lock: in the ids' order
                    try:
                        listener(body)
                    except Exception:  # one that fails loses it, never the rest
                        log.exception("a listener of %r events failed", type)
            for stream in streams:
                stream.notify()
        except Exception:  # an event lost must not fail what it reports
            log.exception("publishing a %r event failed", type)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def guard(self, store_lock: threading.RLock) -> None:
        """Publish holding ``store_lock`` (the daemon's database's) first. An event
        published inside a store transaction then has its listeners' writes (the
        webhooks' outbox rows) in that transaction, committed with the state change it
        reports or not at all; and no thread can hold this bus's lock while it waits
        for the store's, the other way round."""
        self._outer = store_lock

    def held(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The events of ``sandbox_id`` still in the ring, oldest first, as JSON objects
        (the daemon keeps its last :data:`EVENT_RING_SIZE` events, of every sandbox)."""
        with self._lock:
            mine = [e.data for e in self._ring if e.sandbox_id == sandbox_id]
        return [json.loads(data) for data in mine]

    def close(self) -> None:
        """The daemon stops: every stream ends, and no new one starts."""
        self._closed = True
        for stream in list(self._streams):
            with contextlib.suppress(RuntimeError):  # its loop is closed: it ended already
                stream.notify()

    def subscribe(
        self,
        types: Iterable[str] | None = None,
        sandbox_id: str | None = None,
        since: int | None = None,
    ) -> AsyncGenerator[Event | None, None]:
        """The events after id ``since`` (none: from now; 0: all the ring holds), then
        each as it is published, of ``types`` (all, if none) about ``sandbox_id`` (any,
        if none). The first item is a :data:`POSITION` (its ``id`` only: where
        the stream starts); ``None`` is a heartbeat. The slot is held from this call until the
        iterator ends; it ends when the daemon stops.

        :class:`Invalid` for an unknown type; :class:`OverCapacity` when
        ``max_subscribers`` streams are open already.
        """
        wanted = None if types is None else frozenset(types)
        unknown = sorted((wanted or frozenset()) - set(EVENT_TYPES))
        if unknown:
            raise Invalid(
                f"unknown event type {', '.join(map(repr, unknown))}: "
                f"one of {', '.join(EVENT_TYPES)}"
            )
        if self._closed:
            raise Unavailable("the daemon is stopping")
        if len(self._streams) >= self.max_subscribers:
            raise OverCapacity(
                f"{len(self._streams)} event streams are open, the cap is "
                f"{self.max_subscribers}; close one first"
            )
        if since is None:
            cursor = self.last_id
        elif since == 0:
            cursor = self._first_id - 1
        else:
            cursor = since
        stream = _Stream()
        self._streams.add(stream)
        return self._follow(stream, cursor, wanted, sandbox_id)

    async def _follow(
        self, stream: _Stream, cursor: int, types: frozenset[str] | None, sandbox_id: str | None
    ) -> AsyncGenerator[Event | None, None]:
        sent = time.monotonic()
        try:
            yield Event(cursor, POSITION, None, "")  # where a client that reconnects resumes
            while not self._closed:
                gap, batch = self._after(cursor)
                if gap is not None:
                    cursor = gap.id
                    yield gap
                    sent = time.monotonic()
                for event in batch:
                    cursor = event.id
                    if (types is None or event.type in types) and (
                        sandbox_id is None or event.sandbox_id == sandbox_id
                    ):
                        yield event
                        sent = time.monotonic()
                if time.monotonic() - sent >= self.heartbeat_s:
                    yield None  # events pass the filter rarely: keep proxies from closing it
                    sent = time.monotonic()
                if gap is not None or batch:
                    continue
                stream.wake.clear()
                if self.last_id > cursor or self._closed:
                    continue  # published from another thread since the look
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stream.wake.wait(), self.heartbeat_s)
        finally:
            self._streams.discard(stream)

    def _after(self, cursor: int) -> tuple[Event | None, list[Event]]:
        """A ``gap`` when events after ``cursor`` are no longer held, and up to
        :data:`BATCH` of the held events after it (or after the gap)."""
        with self._lock:
            oldest = self._ring[0].id if self._ring else self._next_id
            gap = None
            if cursor >= self._next_id:
                gap = self._gap(cursor, self.last_id, None, "an id this daemon has not given")
            elif cursor + 1 < oldest:
                missed = oldest - cursor - 1 if cursor + 1 >= self._first_id else None
                why = "fell behind" if missed is not None else "before this daemon started"
                gap = self._gap(cursor, oldest - 1, missed, why)
            start = gap.id if gap is not None else cursor
            first = start + 1 - oldest
            held = len(self._ring)
            batch = [self._ring[i] for i in range(max(first, 0), min(first + BATCH, held))]
        return gap, batch

    def _gap(self, after: int, last_lost: int, missed: int | None, reason: str) -> Event:
        body = {
            "id": last_lost,
            "type": GAP,
            "time": utc_stamp(),
            "after": after,
            "missed": missed,
            "reason": reason,
        }
        return Event(last_lost, GAP, None, _encode(body))
