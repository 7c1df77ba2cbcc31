"""What a client's connections may hold of a server: how long, and how many.

uvicorn waits for a request as long as a client likes: a connection that sends
half a request head, or a body a byte a minute, keeps its socket forever, and
any local process may open thousands. :func:`uvicorn_options` gives the daemon
and the gateway uvicorn's h11 protocol with two timers and a count:

* **The request head.** From a connection's start, and again from the end of
  each answer (the idle wait between keep-alive requests), a whole head must
  arrive within ``header_timeout_secs``; bytes trickling in do not restart it.
* **The request body.** While one is being read, ``body_idle_timeout_secs``
  without a byte closes the connection. The wait holds while the server
  itself stops reading (the app has not yet taken what came, so the client
  cannot send) and while the client waits for ``100 Continue``.
* **The count.** At most ``max_per_address`` connections from one client
  address and ``max_total`` in all, WebSockets included. A unix-socket client
  has no address (all would share one), so it counts against the total only.
* **The owner first.** A connection that has sent the daemon's token (its
  bearer token, checked on every request head) is the owner's; any other may be
  anyone's. Once a cap is reached, or the total is within ``owner_share`` of
  its cap, a new connection closes the longest-open connection that is not the
  owner's, is older than half a second (an owner's new connection has that long
  to show its token) and that the server only waits on: for its next request,
  or for the rest of a body it trickles in (one whose answer is under way, a
  stream or a WebSocket, is never cut). A connection let in on that last share
  must send the token with its first request, or it is closed after the answer.
  With no such connection of another to close, one over a cap is answered 503
  with ``Connection: close`` and closed at once. So no local process, holding
  connections open without a token (idle, or sending a body a byte at a time),
  can keep the owner out.
* **Life without a token.** A keep-alive connection that has never sent the
  token is closed when it goes idle ``unauthenticated_keepalive_secs`` after it
  opened, and after an answer given before its body was read: such connections
  cannot be held for good.

Neither timer runs while an answer streams (event streams, downloads) or once a
connection is a WebSocket: the server then waits for nothing from the client.
A timed-out connection is closed without an answer; an app still reading its
body sees the client gone. The protocol is h11 even where httptools is
installed (uvicorn's ``auto`` would pick httptools): one parser to watch.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from forkd import limits
from forkd.errors import Invalid

log = logging.getLogger(__name__)

Wait = Literal["header", "body"]  # what a timed-out connection did not send in time
Cap = Literal["address", "total"]  # which cap refused a connection

REFUSED_WARN_INTERVAL_SECS = 60.0  # a flood of refusals is one log line a minute
# A connection this young is closed for another only when no older one will do: an
# owner's new connection has this long to send the head that shows its token.
EVICT_GRACE_SECS = 0.5


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one server (``forkd serve``, ``forkd gateway``)."""

    header_timeout_secs: float = limits.REQUEST_HEADER_TIMEOUT_SECS
    body_idle_timeout_secs: float = limits.REQUEST_BODY_IDLE_TIMEOUT_SECS
    max_per_address: int = limits.MAX_CONNECTIONS_PER_ADDRESS
    max_total: int = limits.MAX_CONNECTIONS
    owner_share: float = 0.25  # of max_total, kept for connections that send the token
    unauthenticated_keepalive_secs: float = limits.UNAUTHENTICATED_KEEPALIVE_SECS

    @property
    def kept_for_owner(self) -> int:
        return int(self.max_total * self.owner_share)

    def __post_init__(self) -> None:
        if not 0 <= self.owner_share < 1:
            raise Invalid(
                f"the owner's share of connections is from 0 to 1, not {self.owner_share}"
            )
        for secs in (
            self.header_timeout_secs,
            self.body_idle_timeout_secs,
            self.unauthenticated_keepalive_secs,
        ):
            if not (secs > 0 and math.isfinite(secs)):
                raise Invalid(f"a connection timeout must be a positive number, not {secs}")
        if min(self.max_per_address, self.max_total) < 1:
            raise Invalid("connection caps must be at least 1")


@dataclass(frozen=True)
class ConnectionCounts:
    """A limiter's figures, for ``/metrics``."""

    open: int
    refused: dict[Cap, int]
    timed_out: dict[Wait, int]
    closed_for_another: int = 0  # idle connections without the token, closed for a newcomer


class Slot:
    """One admitted connection's place under the caps, given back once."""

    def __init__(
        self, limiter: ConnectionLimiter, address: str | None, holder: Evictable | None
    ) -> None:
        self._limiter: ConnectionLimiter | None = limiter
        self.address = address
        self.holder = holder  # the connection, while it may be closed for another
        self.owner = False  # it has sent the token
        self.on_probation = False  # let in on the owner's share: the token, or closed
        self.opened = time.monotonic()

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._give_back(self)


class Evictable:
    """What a connection says of itself to the limiter."""

    def idle(self) -> bool:
        """The server waits on the client alone: for its next request head (or its first),
        or for the rest of a body (a body trickled in to hold a connection); no answer
        of the server's is under way."""
        raise NotImplementedError

    def evict(self) -> None:
        """Close it for a newcomer."""
        raise NotImplementedError


class ConnectionLimiter:
    """The open connections of one server, admitted under its caps, and what it refused
    or timed out. Used from the event loop's thread only."""

    def __init__(self, connection_limits: ConnectionLimits, owner_token: str | None = None) -> None:
        self.limits = connection_limits
        self._owner_header = None if owner_token is None else f"Bearer {owner_token}".encode()
        self._open = 0
        self._open_from: Counter[str] = Counter()
        self._slots: dict[Slot, None] = {}  # every open slot, the oldest first
        self._refused: Counter[Cap] = Counter()
        self._timed_out: Counter[Wait] = Counter()
        self._evicted = 0
        self._warned_at = -math.inf

    def is_owner(self, authorization: bytes) -> bool:
        """Whether a request's ``Authorization`` is the owner's token."""
        return self._owner_header is not None and hmac.compare_digest(
            authorization, self._owner_header
        )

    def admit(self, address: str | None, holder: Evictable | None = None) -> Slot | Cap:
        """A slot for a new connection from ``address`` (``holder``, which may be closed
        for a later one while idle and not the owner's), or the cap it is over: an idle
        connection of another is closed first to make room."""
        caps = self.limits
        probation = False
        full_here = address is not None and self._open_from[address] >= caps.max_per_address
        if full_here and not self._evict_one(address):
            return self._refuse("address", address)
        if self._open >= caps.max_total - caps.kept_for_owner and not self._evict_one(None):
            if self._open >= caps.max_total:
                return self._refuse("total", address)
            probation = True  # the owner's share: it must prove itself
        self._open += 1
        if address is not None:
            self._open_from[address] += 1
        slot = Slot(self, address, holder)
        slot.on_probation = probation
        self._slots[slot] = None
        return slot

    def _evict_one(self, address: str | None) -> bool:
        """Close the longest-open connection (from ``address``, when given) that is not the
        owner's and that the server only waits on; one younger than
        :data:`EVICT_GRACE_SECS` (an owner's may not have shown its token yet) only when
        no older one will do. Whether there was one."""
        young = time.monotonic() - EVICT_GRACE_SECS
        candidates = [
            slot
            for slot in self._slots
            if not slot.owner
            and slot.holder is not None
            and (address is None or slot.address == address)
            and slot.holder.idle()
        ]
        if not candidates:
            return False
        victim = next((slot for slot in candidates if slot.opened < young), candidates[0])
        holder = victim.holder
        assert holder is not None
        victim.release()
        holder.evict()
        self._evicted += 1
        return True

    def _refuse(self, cap: Cap, address: str | None) -> Cap:
        self._refused[cap] += 1
        self._warn_refused(cap, address)
        return cap

    def count_timeout(self, wait: Wait) -> None:
        self._timed_out[wait] += 1

    def counts(self) -> ConnectionCounts:
        return ConnectionCounts(
            open=self._open,
            refused={"address": self._refused["address"], "total": self._refused["total"]},
            timed_out={"header": self._timed_out["header"], "body": self._timed_out["body"]},
            closed_for_another=self._evicted,
        )

    def _give_back(self, slot: Slot) -> None:
        self._open -= 1
        self._slots.pop(slot, None)
        address = slot.address
        if address is not None:
            self._open_from[address] -= 1
            if self._open_from[address] <= 0:
                del self._open_from[address]

    def _warn_refused(self, cap: Cap, address: str | None) -> None:
        now = time.monotonic()
        if now - self._warned_at < REFUSED_WARN_INTERVAL_SECS:
            return
        self._warned_at = now
        refused = sum(self._refused.values())
        if cap == "total":
            log.warning(
                "refusing connections: %d open, the cap (--max-connections); %d refused so far",
                self._open,
                refused,
            )
        else:
            assert address is not None, "only an address is over the per-address cap"
            log.warning(
                "refusing connections from %s: %d open from it, the cap "
                "(--max-connections-per-address); %d refused so far",
                address,
                self._open_from[address],
                refused,
            )


def client_address(transport: asyncio.BaseTransport) -> str | None:
    """The peer's IP address; None for a unix-socket peer."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


def _refusal(cap: Cap) -> bytes:
    why = "too many connections" + (" from this address" if cap == "address" else "")
    body = json.dumps({"error": f"{why}: close one and retry"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _WatchedFlow(FlowControl):
    """uvicorn's flow control, which says when the server stops or starts reading."""

    def __init__(self, transport: asyncio.Transport, changed: Callable[[], None]) -> None:
        super().__init__(transport)
        self._changed = changed

    def pause_reading(self) -> None:
        super().pause_reading()
        self._changed()

    def resume_reading(self) -> None:
        super().resume_reading()
        self._changed()


class _HoldsSlot(asyncio.Protocol):
    """Mixed into uvicorn's WebSocket protocol: a connection upgraded to a WebSocket
    keeps its slot until it closes."""

    slot: Slot | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            if self.slot is not None:
                self.slot.release()


# uvicorn's WebSocket protocol -> it with _HoldsSlot mixed in (made once, not per connection)
_SLOT_HOLDING: dict[type[asyncio.Protocol], type[asyncio.Protocol]] = {}


def _holding_slot(ws_protocol: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    made = _SLOT_HOLDING.get(ws_protocol)
    if made is None:
        made = type(ws_protocol.__name__, (_HoldsSlot, ws_protocol), {})
        _SLOT_HOLDING[ws_protocol] = made
    return made


class LimitedH11Protocol(H11Protocol, Evictable):
    """uvicorn's h11 protocol under a :class:`ConnectionLimiter` (see the module docstring)."""

    limiter: ClassVar[ConnectionLimiter]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot: Slot | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for: Wait | None = None  # what the running timer waits for
        self._upgraded = False
        self._seen_scope: object = None  # the request whose head was checked for the token
        if self.ws_protocol_class is not None:
            self.ws_protocol_class = _holding_slot(self.ws_protocol_class)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's H11Protocol has it: asyncio gives a stream protocol a Transport
        admitted = self.limiter.admit(client_address(transport), self)
        if not isinstance(admitted, Slot):
            transport.write(_refusal(admitted))
            transport.close()
            return
        self._slot = admitted
        super().connection_made(transport)
        self.flow = _WatchedFlow(transport, self._rearm)
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._slot is None:
            return  # refused in connection_made: uvicorn never knew it
        try:
            super().connection_lost(exc)
        finally:
            self._slot.release()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for == "body":
            self._stop_timer()  # a byte of the body: the idle wait starts over
        super().data_received(data)
        self._note_owner()
        self._rearm()

    def _note_owner(self) -> None:
        """A new request's head: the connection is the owner's once one has the token."""
        scope = getattr(self, "scope", None)
        if scope is None or scope is self._seen_scope or self._slot is None:
            return
        self._seen_scope = scope
        if not self._slot.owner:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            self._slot.owner = self.limiter.is_owner(given)

    def on_response_complete(self) -> None:
        slot = self._slot
        # An answer given before the request's body was read (a 404, a refusal): without
        # the token the rest of that body may not hold the connection open.
        unread = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        self._note_owner()  # a pipelined request begun by the answer's end
        if slot is not None and not slot.owner and not self.transport.is_closing():
            caps = self.limiter.limits
            if (
                unread
                or slot.on_probation
                or time.monotonic() - slot.opened > (caps.unauthenticated_keepalive_secs)
            ):
                self.transport.close()  # let in on the owner's share, or kept alive too long
                return
        self._rearm()  # keep-alive: the next request's head is awaited

    def idle(self) -> bool:
        if self._upgraded or self.transport.is_closing():
            return False
        if self.conn.their_state is h11.IDLE:
            return True  # waiting for a request head
        cycle = getattr(self, "cycle", None)  # uvicorn's request in progress
        return (
            self.conn.their_state is h11.SEND_BODY
            and cycle is not None
            and not cycle.response_started
        )

    def evict(self) -> None:
        self._stop_timer()
        self.transport.close()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._stop_timer()
        self._upgraded = True
        super().handle_websocket_upgrade(event)
        websocket = self.transport.get_protocol()
        assert isinstance(websocket, _HoldsSlot)
        websocket.slot, self._slot = self._slot, None

    def _awaited(self) -> Wait | None:
        """What the server now waits for from the client, if anything."""
        if self._upgraded or self.transport.is_closing():
            return None
        if self.conn.their_state is h11.IDLE:
            return "header"
        if (
            self.conn.their_state is h11.SEND_BODY
            and self.transport.is_reading()
            and not self.conn.they_are_waiting_for_100_continue
        ):
            return "body"
        return None

    def _rearm(self) -> None:
        """Run the timer of what the server now waits for; stop one it no longer waits for."""
        awaited = self._awaited()
        if awaited == self._waiting_for:
            return
        self._stop_timer()
        if awaited is not None:
            caps = self.limiter.limits
            secs = caps.header_timeout_secs if awaited == "header" else caps.body_idle_timeout_secs
            self._timer = self.loop.call_later(secs, self._expire, awaited)
            self._waiting_for = awaited

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._waiting_for = None

    def _expire(self, wait: Wait) -> None:
        self._timer = self._waiting_for = None
        self.limiter.count_timeout(wait)
        log.debug(
            "closing the connection of %s: its request %s did not come in time", self.client, wait
        )
        self.transport.close()


def uvicorn_options(limiter: ConnectionLimiter) -> dict[str, Any]:
    """The arguments of ``uvicorn.Config`` that put its connections under ``limiter``."""
    protocol = type(LimitedH11Protocol.__name__, (LimitedH11Protocol,), {"limiter": limiter})
    return {
        "http": protocol,
        # uvicorn's own idle keep-alive timer: the same wait as the head's, which rules
        # (uvicorn's restarts at any byte).
        "timeout_keep_alive": limiter.limits.header_timeout_secs,
    }
