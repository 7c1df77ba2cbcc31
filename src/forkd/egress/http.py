"""HTTP/1.1 through the proxy one request at a time, each request's Host checked.

The guest's side is parsed by h11 as a server, the upstream's by h11 as a
client: every request on a kept-alive connection names its host again and is
judged again, and one that names another host than the connection's first is
answered 421 and the connection closed (the upstream connection belongs to one
host). A request with both Content-Length and Transfer-Encoding, a CONNECT, or
a head over 64 KiB or slower than 10 s is refused: the proxy never forwards
what the upstream might frame otherwise than it did. Redirects are not followed:
the guest's next request is judged as any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11

from forkd.egress.decide import Refused, checked_name, ip_literal
from forkd.egress.meter import Meter
from forkd.egress.splice import CHUNK, Counts, carry, close_soon, splice

MAX_HEAD_BYTES = 64 * 1024
HEAD_SECS = 10.0
BODY_IDLE_SECS = 300.0
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Headers = list[tuple[bytes, bytes]]


@dataclass
class Exchange:
    """One request, as the record of it and the transform see it."""

    host: str
    method: str
    path: str  # without its query
    secrets: list[str]
    counts: Counts


# (name) -> an upstream connection for it; Refused when it may not have one.
OpenUpstream = Callable[[str], Awaitable[Stream]]
# (name, headers) -> the headers to send and the secrets put in them.
Transform = Callable[[str, Headers], tuple[Headers, list[str]]]
# (exchange, refusal or None, ended early because) -> None
Note = Callable[[Exchange, str | None, str | None], None]


def _refusal(status: int, text: str) -> list[h11.Event]:
    body = f"forkd egress proxy: {text}\n".encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    reason = HTTPStatus(status).phrase.encode()
    return [
        h11.Response(status_code=status, headers=headers, reason=reason),
        h11.Data(data=body),
        h11.EndOfMessage(),
    ]


class HttpSession:
    def __init__(
        self,
        guest: Stream,
        first: bytes,
        open_upstream: OpenUpstream,
        note: Note,
        *,
        fixed_name: str | None = None,
        transform: Transform | None = None,
        default_host: str | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.guest = guest
        self.server = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        if first:  # (h11 takes empty data for the end of the connection)
            self.server.receive_data(first)
        self.open_upstream = open_upstream
        self.note = note
        self.fixed_name = fixed_name  # a TLS connection's name: every request's Host
        self.transform = transform
        self.upstream: Stream | None = None
        self.client: h11.Connection | None = None
        self.name: str | None = None
        self.default_host = default_host  # a request without Host: where it was sent
        self.meter = meter or Meter()  # the sandbox's share: bodies pass within it

    async def run(self) -> None:
        try:
            while await self._one_request():
                self.server.start_next_cycle()
                assert self.client is not None
                self.client.start_next_cycle()
        except h11.RemoteProtocolError as exc:  # about the guest's own bytes
            self._answer(_refusal(400, f"malformed HTTP: {exc}"))
        except h11.LocalProtocolError:  # about what the proxy made: never quoted back
            self._answer(_refusal(400, "the request cannot be sent on as it is"))
        finally:
            if self.upstream is not None:
                close_soon(self.upstream[1])

    # ------------------------------------------------------------ plumbing

    async def _event(
        self, conn: h11.Connection, reader: asyncio.StreamReader, timeout: float
    ) -> h11.Event:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED:  # never: CONNECT is refused, a 101 is spliced (_switched)
                raise h11.LocalProtocolError("read past the end of a message")
            data = await asyncio.wait_for(reader.read(CHUNK), timeout)
            conn.receive_data(data)

    def _answer(self, events: list[h11.Event]) -> None:
        """Events to the guest, if it may still be answered."""
        with contextlib.suppress(h11.LocalProtocolError):
            for event in events:
                self.guest[1].write(self.server.send(event) or b"")

    # ------------------------------------------------------------ one exchange

    async def _one_request(self) -> bool:
        """Serve the next request; False when the connection is done."""
        # The first head whole within HEAD_SECS (not each of its reads); a kept-alive
        # connection may wait BODY_IDLE_SECS for its next one.
        wait = HEAD_SECS if self.client is None else BODY_IDLE_SECS
        try:
            event = await asyncio.wait_for(self._event(self.server, self.guest[0], wait), wait)
        except TimeoutError:
            return False
        if isinstance(event, h11.ConnectionClosed):
            return False
        assert isinstance(event, h11.Request), event
        exchange = Exchange(
            "",
            event.method.decode("ascii", "replace"),
            event.target.decode("ascii", "replace").split("?", 1)[0][:512],
            [],
            Counts(),
        )
        try:
            headers = self._checked(event, exchange)
            if self.upstream is None:
                self.upstream = await self.open_upstream(exchange.host)
                self.client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
                self.name = exchange.host
            elif exchange.host != self.name:
                raise _Misdirected(f"this connection is to {self.name}, not {exchange.host}")
        except _Misdirected as exc:
            self.note(exchange, str(exc), None)
            self._answer(_refusal(421, str(exc)))
            return False
        except _Malformed as exc:
            self.note(exchange, str(exc), None)
            self._answer(_refusal(400, str(exc)))
            return False
        except Refused as exc:
            self.note(exchange, str(exc), None)
            self._answer(_refusal(403, str(exc)))
            return False
        try:
            request = h11.Request(method=event.method, target=event.target, headers=headers)
        except h11.LocalProtocolError:  # h11's words would quote the headers: a value put in
            self.note(exchange, "a header the proxy made is not valid HTTP", None)
            self._answer(_refusal(400, "a header of this request is not valid HTTP as sent"))
            return False
        ended = await self._forward(request, exchange)
        self.note(exchange, None, ended)
        return ended is None and self._both_done()

    def _checked(self, request: h11.Request, exchange: Exchange) -> Headers:
        """The request's headers to send on; :class:`Refused` for what is not let out."""
        if request.http_version not in (b"1.0", b"1.1"):
            raise _Malformed(
                f"HTTP/{request.http_version.decode('ascii', 'replace')}: only "
                "HTTP/1.0 and 1.1 are served in the clear"
            )
        if self.fixed_name is not None and not request.target.startswith(b"/"):
            raise _Malformed("an intercepted host takes requests in origin form (/path)")
        if request.method == b"CONNECT":
            raise Refused("CONNECT is not served: connect to the host itself")
        names = [name for name, _ in request.headers]
        if b"content-length" in names and b"transfer-encoding" in names:
            raise Refused("both Content-Length and Transfer-Encoding: refused")
        hosts = [value for name, value in request.headers if name == b"host"]
        if not hosts and self.default_host is not None:  # HTTP/1.0: judged by address
            hosts = [self.default_host.encode()]
        if len(hosts) != 1:
            raise Refused("a request must name its host once (Host)")
        given = hosts[0].decode("ascii", "replace")
        host = given.rsplit(":", 1)[0] if not given.endswith("]") else given
        literal = ip_literal(host)
        exchange.host = str(literal) if literal is not None else checked_name(host)
        if self.fixed_name is not None and exchange.host != self.fixed_name:
            raise _Misdirected(f"this TLS connection is to {self.fixed_name}, not {exchange.host}")
        headers: Headers = list(request.headers.raw_items())  # as the guest spelled them
        if b"host" not in names:  # HTTP/1.0 without one: sent on as 1.1, which needs it
            headers.insert(0, (b"Host", hosts[0]))
        if self.transform is not None:
            headers, exchange.secrets = self.transform(exchange.host, headers)
        return headers

    def _both_done(self) -> bool:
        assert self.client is not None
        states = (
            self.server.our_state,
            self.server.their_state,
            self.client.our_state,
            self.client.their_state,
        )
        return all(state is h11.DONE for state in states)

    async def _forward(self, request: h11.Request, exchange: Exchange) -> str | None:
        """Send the request and its body, then the answer back; why it ended early."""
        assert self.upstream is not None and self.client is not None
        up_writer = self.upstream[1]
        try:
            up_writer.write(self.client.send(request) or b"")
            while True:  # the body
                event = await self._event(self.server, self.guest[0], BODY_IDLE_SECS)
                await self._send(self.client, event, up_writer, exchange.counts, True)
                if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            return await self._answer_back(exchange)
        except TimeoutError:
            return "timed out"
        except (OSError, h11.RemoteProtocolError) as exc:
            if self.server.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                self._answer(_refusal(502, f"{exchange.host} answered badly: {exc}"))
            return f"upstream: {exc}"

    async def _answer_back(self, exchange: Exchange) -> str | None:
        assert self.upstream is not None and self.client is not None
        while True:
            event = await self._event(self.client, self.upstream[0], BODY_IDLE_SECS)
            if isinstance(event, h11.ConnectionClosed):
                return None if self.server.our_state is h11.DONE else "upstream closed"
            await self._send(self.server, event, self.guest[1], exchange.counts, False)
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                return await self._switched(exchange)
            if isinstance(event, h11.EndOfMessage):
                return None

    async def _send(
        self,
        conn: h11.Connection,
        event: h11.Event,
        writer: asyncio.StreamWriter,
        counts: Counts,
        outward: bool,
    ) -> None:
        """``event`` on through ``conn`` to ``writer``; a body's bytes counted, within the
        sandbox's share and rate."""
        data = conn.send(event) or b""
        if isinstance(event, h11.Data):
            await carry(
                data, writer, counts, self.meter, outward, BODY_IDLE_SECS, counted=len(event.data)
            )
        else:
            writer.write(data)
            await writer.drain()

    async def _switched(self, exchange: Exchange) -> str | None:
        """101 Switching Protocols (a WebSocket): the rest is the two peers' bytes."""
        assert self.upstream is not None and self.client is not None
        leftover_up, _ = self.client.trailing_data
        leftover_guest, _ = self.server.trailing_data
        if leftover_up:
            self.guest[1].write(leftover_up)
        if leftover_guest:
            self.upstream[1].write(leftover_guest)
        ended = await splice(self.guest, self.upstream, exchange.counts, self.meter)
        return ended or "switched protocols"


class _Misdirected(Refused):
    """A request for another host than its connection's: 421."""


class _Malformed(Refused):
    """A request the proxy does not serve as it is: 400."""
