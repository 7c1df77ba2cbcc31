"""The HTTP reverse proxy to a guest's TCP port: ``/v1/sandboxes/{id}/ports/{port}/{path}``
and the preview URLs' ``/v1/preview/{token}/{path}`` (docs/API.md, "Ports").

One HTTP/1.1 exchange per request, over a connection of its own to the
guest, framed by h11. Bodies stream both ways a piece at a time: a piece is
read from one side only once the other took the last one, so nothing waits
in the daemon but one read's worth. The guest gets a bounded time to accept
the connection and to answer with a head; after that a response may stream
for as long as the client reads it, while its sandbox lives (a sandbox killed
under an open stream ends it within :data:`LIVENESS_SECS`). WebSocket
upgrades arrive as WebSocket scopes and are :mod:`forkd.controller.port_ws`'s.
These routes are absent from docs/openapi.json: their bodies are the guest's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Annotated

import h11
from fastapi import APIRouter, Path, Request, Response, WebSocket
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from forkd import limits
from forkd.controller.preview_hosts import AT_ROOT, OWN_ORIGIN
from forkd.controller.services import Services
from forkd.controller.services.ports import GuestLink
from forkd.errors import GuestError, Invalid

PROXY_PATH = "/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}"
PREVIEW_PATH = "/v1/preview/{token}/{path:path}"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
READ_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
LIVENESS_SECS = 2.0  # how often an idle stream checks that its sandbox still runs
HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
    )
)
# Never passed to the guest: the daemon's credentials, what the proxy sets itself, and
# the page a request came from (on the daemon's origin, another sandbox's preview URL,
# its token with it).
NOT_TO_GUEST = frozenset(
    (
        "authorization",
        "host",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-forwarded-prefix",
        "referer",
    )
)
# Set on every answer from a guest, whatever the guest says: a page never tells the
# next one (another sandbox's, anyone's) the URL it was, preview token and all.
REFERRER_POLICY = (b"referrer-policy", b"no-referrer")
# Never passed from the guest to a browser: all sandboxes' previews share the daemon's
# origin, and these would reach past the guest's own prefix. Service-Worker-Allowed
# would let a guest's service worker control the whole origin (other sandboxes'
# preview URLs, their tokens); Clear-Site-Data would wipe what the origin stores.
# Referrer-Policy is the proxy's own (REFERRER_POLICY), whatever the guest says.
NOT_FROM_GUEST = frozenset(("service-worker-allowed", "clear-site-data", "referrer-policy"))
# Dropped too where the guest's pages share the daemon's origin: a guest's
# Cross-Origin-Opener-Policy equal to the console's would keep a console window its
# page opens reachable from that page (the console's own COOP severs it otherwise);
# the others set policy for the whole origin (NEL with Report-To would have a browser
# report every later URL of the origin, other sandboxes' preview tokens included, to
# the guest's server; Alt-Svc and HSTS would redirect or pin it).
NOT_FROM_GUEST_ON_OUR_ORIGIN = frozenset(
    (
        "cross-origin-opener-policy",
        "nel",
        "report-to",
        "reporting-endpoints",
        "alt-svc",
        "strict-transport-security",
    )
)
COOKIE_PLACE_ATTRIBUTES = frozenset((b"path", b"domain"))
Port = Annotated[int, Path(ge=1, le=65535, description="a TCP port of the guest")]

router = APIRouter(tags=["ports"])


class GuestGone(Exception):
    """The sandbox stopped while a stream was open."""


def guest_headers(
    scope: Scope, port: int, prefix: str, tag: bytes | None = None
) -> list[tuple[bytes, bytes]]:
    """The request's headers as the guest gets them: no hop-by-hop headers, no
    Authorization, no Referer, ``Host: localhost:<port>``, and X-Forwarded-* set (never
    the client's own, which could say anything; the prefix is empty for a request that
    came for a preview host's root paths). With ``tag`` (the guest's pages are on the
    daemon's origin: :func:`cookie_tag`), of the cookies only the guest's own
    (:func:`own_cookies`)."""
    state = scope.get("state", {})
    raw: list[tuple[bytes, bytes]] = scope["headers"]
    if tag is not None:
        raw = own_cookies(raw, tag)
    if state.get(AT_ROOT):
        prefix = ""  # the guest's paths are the host's own
    named_in_connection = {
        token.strip().lower().encode()
        for k, v in raw
        if k.lower() == b"connection"
        for token in v.decode("latin-1").split(",")
    }
    drop = {h.encode() for h in HOP_BY_HOP | NOT_TO_GUEST} | named_in_connection
    kept = [(k, v) for k, v in raw if k.lower() not in drop]
    host = next((v for k, v in raw if k.lower() == b"host"), b"")
    client = scope.get("client")
    kept += [
        (b"host", f"localhost:{port}".encode()),
        (b"x-forwarded-proto", str(scope.get("scheme", "http")).encode()),
    ]
    if prefix:
        kept.append((b"x-forwarded-prefix", prefix.encode()))
    if host:
        kept.append((b"x-forwarded-host", host))
    if client:
        kept.append((b"x-forwarded-for", str(client[0]).encode()))
    return kept


def client_headers(
    headers: list[tuple[bytes, bytes]],
    our_origin_prefix: str | None = None,
    tag: bytes | None = None,
) -> list[tuple[bytes, bytes]]:
    """The guest's answer headers as the client gets them: no hop-by-hop headers, none
    that would act on the daemon's whole origin (``NOT_FROM_GUEST``). With
    ``our_origin_prefix`` (the route's prefix: the guest's pages are on the daemon's
    origin) its cookies are kept to that prefix (and named with ``tag``) and
    ``NOT_FROM_GUEST_ON_OUR_ORIGIN`` is dropped as well."""
    named_in_connection = {
        token.strip().lower().encode()
        for k, v in headers
        if k.lower() == b"connection"
        for token in v.decode("latin-1").split(",")
    }
    dropped = HOP_BY_HOP | NOT_FROM_GUEST
    if our_origin_prefix is not None:
        dropped |= NOT_FROM_GUEST_ON_OUR_ORIGIN
    drop = {h.encode() for h in dropped} | named_in_connection
    kept = [(k, v) for k, v in headers if k.lower() not in drop]
    path = None if our_origin_prefix is None else f"{our_origin_prefix}/".encode()
    answer = [
        (k, confined_cookie(v, path, tag) if k.lower() == b"set-cookie" else v) for k, v in kept
    ]
    return [*answer, REFERRER_POLICY]


def cookie_tag(request: Request | WebSocket, prefix: str) -> bytes | None:
    """The tag of the guest's cookies for a request on the daemon's origin (the preview
    key's :meth:`~forkd.controller.services.preview_tokens.PreviewKey.cookie_tag`);
    None on a preview host of its own, where the guest's cookies are host-only."""
    if request.scope.get("state", {}).get(OWN_ORIGIN):
        return None
    services: Services = request.app.state.services
    return services.ports.key.cookie_tag(prefix)


def own_cookies(headers: list[tuple[bytes, bytes]], tag: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` with, of their cookies, only those whose names begin with ``tag`` (set by
    this guest's answers, :func:`confined_cookie`), the tag taken off. Whatever else a
    browser sends on the daemon's origin was set by a page's script, perhaps another
    sandbox's with ``path=/``, or for the console: none of this guest's."""
    pairs = []
    for key, value in headers:
        if key.lower() != b"cookie":
            continue
        for pair in value.split(b";"):
            name, sep, rest = pair.strip().partition(b"=")
            if sep and name.startswith(tag) and len(name) > len(tag):
                pairs.append(name[len(tag) :] + b"=" + rest)
    kept = [(k, v) for k, v in headers if k.lower() != b"cookie"]
    return kept + ([(b"cookie", b"; ".join(pairs))] if pairs else [])


def confined_cookie(set_cookie: bytes, path: bytes | None, tag: bytes | None = None) -> bytes:
    """A guest's ``Set-Cookie`` value kept to its own host (no ``Domain``: a preview
    host's cookie never reaches another sandbox's host under the same domain) and,
    given ``path``, to that path (its own ``Path`` replaced: on the daemon's origin a
    browser then sends it only to that guest's pages, never to the API, the console or
    another sandbox's preview, and it cannot crowd theirs out), its name beginning with
    ``tag`` when given (:func:`own_cookies` passes back only those)."""
    name_value, *attributes = set_cookie.split(b";")
    if tag is not None:
        name_value = tag + name_value.strip()
    dropped = COOKIE_PLACE_ATTRIBUTES if path is not None else {b"domain"}
    kept = [name_value.strip()] + [
        a.strip()
        for a in attributes
        if a.strip() and a.split(b"=", 1)[0].strip().lower() not in dropped
    ]
    return b"; ".join(kept + ([b"Path=" + path] if path is not None else []))


def guest_target(scope: Scope, prefix_segments: int) -> bytes:
    """The path and query after the route's prefix, as the client sent them (raw)."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    rest = raw_path.split(b"?", 1)[0].split(b"/", prefix_segments + 1)
    target = b"/" + (rest[prefix_segments + 1] if len(rest) > prefix_segments + 1 else b"")
    query: bytes = scope.get("query_string", b"")
    return target + (b"?" + query if query else b"")


async def connect_guest(link: GuestLink) -> socket.socket:
    """A connected TCP socket to the linked guest port; :class:`GuestError` when none is made."""
    where = f"port {link.port} of sandbox {link.sandbox_id!r}"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(
            asyncio.get_running_loop().sock_connect(sock, (link.host, link.host_port)),
            limits.PORT_CONNECT_SECS,
        )
        return sock
    except BaseException as exc:
        sock.close()
        if isinstance(exc, Exception):
            raise _connect_failed(where, exc) from exc
        raise


def _connect_failed(where: str, exc: Exception) -> Exception:
    if isinstance(exc, ConnectionRefusedError):
        return GuestError(f"nothing listens on {where} (connection refused)")
    if isinstance(exc, TimeoutError):
        return GuestError(
            f"{where} did not accept a connection within {limits.PORT_CONNECT_SECS:g} s"
        )
    if isinstance(exc, OSError):
        return GuestError(f"cannot connect to {where}: {exc}")
    return exc


async def open_guest(link: GuestLink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over :func:`connect_guest`'s socket."""
    return await asyncio.open_connection(sock=await connect_guest(link))


async def read_watching(reader: asyncio.StreamReader, link: GuestLink) -> bytes:
    """The next bytes from the guest (b"" at its end); :class:`GuestGone` once the
    sandbox stopped, however long the guest was silent."""
    reading = asyncio.ensure_future(reader.read(READ_BYTES))
    try:
        while True:
            done, _ = await asyncio.wait({reading}, timeout=LIVENESS_SECS)
            if done:
                return reading.result()
            if not link.alive():
                raise GuestGone
    finally:
        reading.cancel()


class GuestExchange:
    """One request to the guest and its answer, over a connection of its own."""

    def __init__(
        self, link: GuestLink, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.link = link
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.uploading: asyncio.Task[None] | None = None

    def _where(self) -> str:
        return f"port {self.link.port} of sandbox {self.link.sandbox_id!r}"

    async def _write(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), limits.PORT_HEAD_SECS)

    async def start(
        self, request: Request, headers: list[tuple[bytes, bytes]], target: bytes
    ) -> h11.Response:
        """Send the request (its body streams on in the background) and return the
        answer's head; :class:`GuestError` when the guest does not give one in time."""
        has_length = any(k.lower() == b"content-length" for k, _ in headers)
        if not has_length and "transfer-encoding" in request.headers:
            headers = [*headers, (b"transfer-encoding", b"chunked")]
        headers = [*headers, (b"connection", b"close")]
        try:
            await self._write(h11.Request(method=request.method, target=target, headers=headers))
        except (h11.LocalProtocolError, ValueError) as exc:
            raise GuestError(f"cannot forward this request to {self._where()}: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            raise GuestError(f"{self._where()} closed the connection: {exc}") from exc
        self.uploading = asyncio.ensure_future(self._upload(request))
        head = asyncio.ensure_future(self._head())
        try:
            await asyncio.wait({self.uploading, head}, return_when=asyncio.FIRST_COMPLETED)
            if not head.done():
                self.uploading.result()  # the upload failed: say why
                await asyncio.wait_for(asyncio.shield(head), limits.PORT_HEAD_SECS)
            return head.result()
        except TimeoutError as exc:
            raise GuestError(
                f"{self._where()} sent no answer within {limits.PORT_HEAD_SECS:g} s"
            ) from exc
        finally:
            head.cancel()

    async def _upload(self, request: Request) -> None:
        try:
            async for chunk in request.stream():
                if chunk:
                    await self._write(h11.Data(data=chunk))
            await self._write(h11.EndOfMessage())
        except ClientDisconnect:
            self.writer.close()  # the guest must not take half a body for a whole one
            raise
        except (OSError, TimeoutError, h11.LocalProtocolError) as exc:
            raise GuestError(f"{self._where()} did not take the request body: {exc}") from exc

    async def _head(self) -> h11.Response:
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):  # 100 Continue: not for us
                raise GuestError(f"{self._where()} answered with no HTTP head")

    async def _next_event(self) -> h11.Event:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise GuestError(f"{self._where()} did not answer in HTTP/1.1: {exc}") from exc
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED:  # never: no CONNECT or Upgrade is sent to the guest
                raise h11.LocalProtocolError("read past the end of the answer")
            data = await read_watching(self.reader, self.link)
            if not data and self.h11.their_state is h11.SEND_RESPONSE:
                raise GuestError(
                    f"{self._where()} closed the connection without answering "
                    "(does anything listen there?)"
                )
            self.h11.receive_data(data)

    async def body(self) -> AsyncIterator[bytes]:
        """The answer's body, a piece at a time, until it ends."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return

    async def close(self) -> None:
        if self.uploading is not None:
            self.uploading.cancel()
            with contextlib.suppress(BaseException):
                await self.uploading
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


class GuestResponse(Response):
    """The guest's answer: its head as received, its body streamed as it comes.

    The connection (and the sandbox's connection slot) is let go when the body
    ended, the client went away, or the sandbox stopped; a body cut short ends
    the client's connection too, so it never takes a part for the whole.
    """

    def __init__(
        self,
        exchange: GuestExchange,
        head: h11.Response,
        stack: contextlib.AsyncExitStack,
        our_origin_prefix: str | None,
        tag: bytes | None = None,
    ) -> None:
        super().__init__(status_code=head.status_code)
        self.exchange = exchange
        self.head = head
        self.stack = stack
        self.our_origin_prefix = our_origin_prefix
        self.tag = tag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.head.status_code,
                    "headers": client_headers(
                        list(self.head.headers), self.our_origin_prefix, self.tag
                    ),
                }
            )
            pumping = asyncio.ensure_future(self._pump(send))
            watching = asyncio.ensure_future(self._client_gone(receive))
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
            for task in (pumping, watching):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        finally:
            await self.stack.aclose()

    async def _pump(self, send: Send) -> None:
        with contextlib.suppress(GuestGone, GuestError, OSError):
            async for piece in self.exchange.body():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _client_gone(self, receive: Receive) -> None:
        """Returns when the client went away (after its body was read, if it had one)."""
        if self.exchange.uploading is not None:
            with contextlib.suppress(BaseException):
                await self.exchange.uploading
        while (await receive())["type"] != "http.disconnect":
            pass


async def forward(
    request: Request, svc: Services, sandbox_id: str, port: int, prefix: str, prefix_segments: int
) -> Response:
    """Send ``request`` on to guest ``port`` and answer with what the guest answers."""
    stack = contextlib.AsyncExitStack()
    try:
        by_preview = prefix.startswith("/v1/preview/")
        link = await stack.enter_async_context(
            svc.ports.link(sandbox_id, port, by_preview=by_preview)
        )
        reader, writer = await open_guest(link)
        exchange = GuestExchange(link, reader, writer)
        stack.push_async_callback(exchange.close)
        tag = cookie_tag(request, prefix)
        head = await exchange.start(
            request,
            guest_headers(request.scope, port, prefix, tag),
            guest_target(request.scope, prefix_segments),
        )
    except ClientDisconnect:
        await stack.aclose()
        raise Invalid("the request body ended early: the client went away") from None
    except BaseException:
        await stack.aclose()
        raise
    return GuestResponse(exchange, head, stack, None if tag is None else prefix, tag)


def _services(request: Request) -> Services:
    services: Services = request.app.state.services  # Starlette's state holds Any
    return services


@router.api_route(PROXY_PATH, methods=METHODS, include_in_schema=False)
async def proxy(request: Request, sandbox_id: str, port: Port, path: str) -> Response:
    """Guest ``port``'s answer to the request, behind the bearer token."""
    prefix = f"/v1/sandboxes/{sandbox_id}/ports/{port}"
    return await forward(request, _services(request), sandbox_id, port, prefix, 5)


@router.api_route(PREVIEW_PATH, methods=METHODS, include_in_schema=False)
async def preview(request: Request, token: str, path: str) -> Response:
    """The same through a preview URL: the token, not a bearer, says which port."""
    svc = _services(request)
    sandbox_id, port = svc.ports.resolve_preview(token)
    return await forward(request, svc, sandbox_id, port, f"/v1/preview/{token}", 3)
