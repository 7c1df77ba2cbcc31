"""One TCP connection a guest opened, served by the egress proxy from its first bytes
to its end.

Where it was going (``SO_ORIGINAL_DST``) and its first bytes, peeked, say how it is
judged: a TLS ClientHello by its server name, the bytes passed through untouched
or, for a host with rules or secrets, the TLS terminated (:class:`Interception`) and
its requests served as HTTP; plain HTTP by each request's Host (:mod:`.http`);
anything else by the address alone. The upstream connection is opened from a
socket made inside the sandbox's namespace (:class:`~.attachment.UpstreamSockets`),
and every connection and request is written to the proxy's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Protocol

from forkd.egress import decide, sniff
from forkd.egress.attachment import Attachment, going
from forkd.egress.decide import Refused
from forkd.egress.http import Exchange, Headers, HttpSession, Stream
from forkd.egress.records import EgressLog, EgressRecord
from forkd.egress.resolver import Resolver
from forkd.egress.splice import Counts, close_socket_soon, close_soon, readable, splice_sockets
from forkd.vmm.jail.egress import Egress

# The proxy's logger, as before its connections had a module of their own.
log = logging.getLogger("forkd.egress.proxy")

FIRST_BYTES_SECS = 1.0  # a guest silent this long speaks raw TCP (the server first)
# ... unless raw TCP to where it connected would be refused anyway (a policy of names):
# then only its TLS or HTTP can go out, so its first bytes are waited for this long.
# Under TCG on a loaded host git's gnutls was silent for over a second after connecting.
QUIET_CLIENT_SECS = 15.0
CONNECT_SECS = 10.0
SO_ORIGINAL_DST = 80
PEEK_BYTES = 16 * 1024
HELLO_SECS = 10.0  # a ClientHello must arrive whole within this
# The guest's side of an intercepted handshake: under TCG on a loaded host a guest's
# TLS library (git's gnutls) took over 10 s to finish it.
GUEST_HANDSHAKE_SECS = 30.0
STREAM_LIMIT = 64 * 1024  # what a stream (HTTP served, TLS terminated) reads ahead


class Interception(Protocol):
    """What terminates TLS for hosts with rules or secrets (:mod:`.intercept`)."""

    def wanted(self, name: str, policy: Egress) -> bool: ...

    async def server_context(self, name: str) -> ssl.SSLContext: ...

    def upstream_context(self) -> ssl.SSLContext: ...

    def transform(
        self, name: str, policy: Egress, headers: Headers
    ) -> tuple[Headers, list[str]]: ...


class Proxy(Protocol):
    """What a connection reads of the proxy serving it, each time it needs it."""

    @property
    def resolver(self) -> Resolver: ...

    @property
    def interception(self) -> Interception | None: ...

    @property
    def log(self) -> EgressLog: ...


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    """Where the guest's connection was going before the namespace redirected it."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!2xH4s", raw)
    return ipaddress.IPv4Address(address), port


@dataclass
class _Guest:
    """The guest's connection: a socket, until streams are made of it (which then own it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writer: asyncio.StreamWriter | None = None

    async def streams(self) -> Stream:
        reader, self.writer = await asyncio.open_connection(sock=self.sock, limit=STREAM_LIMIT)
        return reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            close_soon(self.writer)
        else:
            close_socket_soon(self.sock)


class Connection:
    """The guest's connection ``conn``, accepted by ``proxy`` in ``sb``'s namespace."""

    def __init__(self, proxy: Proxy, sb: Attachment, conn: socket.socket) -> None:
        self.proxy = proxy
        self.sb = sb
        self.conn = conn

    async def serve(self) -> None:
        """Decide by what the guest's first bytes say, read without taking them (peeked):
        a connection passed through or intercepted starts from its first byte."""
        conn, sb = self.conn, self.sb
        conn.setblocking(False)
        no_delay(conn)
        guest = _Guest(conn)
        try:
            address, port = original_destination(conn)
            first = await peek(conn, FIRST_BYTES_SECS)
            if not first and not self._raw_allowed(address):
                first = await peek(conn, QUIET_CLIENT_SECS)
            if sniff.looks_like_tls(first):
                await self._tls(guest, address, port)
            elif sniff.looks_like_http(first):
                await self._http(guest, address, port)
            else:
                await self._raw(guest, address, port)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError) as exc:
            log.debug("egress %s: %s", sb.vm_id, exc)
        except Exception:  # a bug of the proxy's: said, and only this connection ends
            log.exception("egress proxy of %s: a connection failed", sb.vm_id)
        finally:
            guest.close()

    def _raw_allowed(self, address: ipaddress.IPv4Address) -> bool:
        """Whether raw TCP to ``address`` could leave (what :meth:`_raw` decides first)."""
        try:
            decide.check_address(address, self.sb.policy, self.sb.fence, named=False)
        except Refused:
            return False
        return True

    async def _http(self, guest: _Guest, address: ipaddress.IPv4Address, port: int) -> None:
        """Plain HTTP: each request judged by its Host (by ``address`` without one)."""
        session = HttpSession(
            await guest.streams(),
            b"",
            lambda name: self._open(name, port),
            lambda ex, refused, ended: self._noted(port, ex, refused, ended),
            default_host=str(address),
            meter=self.sb.meter,
        )
        await session.run()

    async def _connect(self, address: ipaddress.IPv4Address, port: int) -> socket.socket:
        sock = await self.sb.sockets.take()
        try:
            sock.setblocking(False)
            no_delay(sock)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (str(address), port)), CONNECT_SECS)
            return sock
        except TimeoutError:
            sock.close()
            raise Refused(f"{address}:{port} did not answer in {CONNECT_SECS:.0f} s") from None
        except OSError as exc:
            sock.close()
            raise Refused(f"{address}:{port}: {exc.strerror or exc}") from None
        except BaseException:  # cancelled (a policy change, a release) while connecting
            sock.close()
            raise

    async def _open(self, name: str, port: int, tls: ssl.SSLContext | None = None) -> Stream:
        """:meth:`_open_socket`, as streams (over TLS of our own when ``tls``)."""
        sock = await self._open_socket(name, port)
        return await _streams(sock, (tls, name) if tls is not None else None)

    async def _open_socket(self, name: str, port: int) -> socket.socket:
        """An upstream connection for ``name`` as a guest gave it: an address literal is
        judged as an address, anything else as a name."""
        sb = self.sb
        literal = decide.ip_literal(name)
        if literal is not None:
            decide.check_address(literal, sb.policy, sb.fence, named=False)
            going(sb, None, literal)
            return await self._connect(literal, port)
        name = decide.checked_name(name)
        going(sb, name, None)  # before the first wait: a policy change meanwhile sees it
        address = await decide.destination(name, sb.policy, sb.fence, self.proxy.resolver)
        going(sb, name, address)
        sock = await self._connect(address, port)
        if not sb.policy.allows_name(name):  # changed while it resolved or connected
            sock.close()
            raise Refused(f"{name} is not allowed by the sandbox's network policy")
        return sock

    async def _tls(self, guest: _Guest, address: ipaddress.IPv4Address, port: int) -> None:
        sb = self.sb
        conn = guest.sock
        try:
            hello = await peek_hello(conn)
        except (sniff.NotAHello, TimeoutError) as exc:
            await _alert(conn)
            self._refused("tls", None, port, f"no readable ClientHello: {exc}")
            return
        record = EgressRecord(sb.vm_id, "allowed", "tls", hello.server_name or str(address), port)
        try:
            if hello.server_name is None:
                decide.check_address(address, sb.policy, sb.fence, named=False)
                going(sb, None, address)
                upstream = await self._connect(address, port)
            else:
                literal = decide.ip_literal(hello.server_name)
                record.host = str(literal) if literal else decide.checked_name(hello.server_name)
                if literal is None and self._intercepted(record.host):
                    if not sb.policy.allows_name(record.host):  # no certificate minted for it
                        raise Refused(
                            f"{record.host} is not allowed by the sandbox's network policy"
                        )
                    await self._intercept(guest, record.host, hello, port)
                    return
                upstream = await self._open_socket(record.host, port)
        except Refused as exc:
            await _alert(conn)
            record.verdict, record.reason = "refused", str(exc)
            self.proxy.log.add(record)
            return
        record.address = str(upstream.getpeername()[0])
        await self._spliced(record, guest.sock, upstream)

    def _intercepted(self, name: str) -> bool:
        interception = self.proxy.interception
        return interception is not None and interception.wanted(name, self.sb.policy)

    async def _intercept(
        self, guest: _Guest, name: str, hello: sniff.ClientHello, port: int
    ) -> None:
        """Terminate the guest's TLS with a certificate for ``name`` minted by the
        daemon's CA, and serve its requests as HTTP/1.1 to ``name`` over a TLS
        connection of our own, verified; substitutions by :meth:`Interception.transform`."""
        sb = self.sb
        assert self.proxy.interception is not None
        interception = self.proxy.interception
        if hello.alpn and "http/1.1" not in hello.alpn:
            await _alert(guest.sock)
            raise Refused(
                f"{name} is intercepted and speaks HTTP/1.1 here: the client "
                f"offered only {', '.join(hello.alpn)}"
            )
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT)
        protocol = asyncio.StreamReaderProtocol(reader)
        certificate = await interception.server_context(name)
        try:
            transport, _ = await asyncio.wait_for(
                loop.connect_accepted_socket(
                    lambda: protocol,
                    guest.sock,
                    ssl=certificate,
                    ssl_handshake_timeout=GUEST_HANDSHAKE_SECS,
                ),
                GUEST_HANDSHAKE_SECS + 5.0,
            )
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            raise Refused(
                f"{name} is intercepted and the guest's TLS client did not take the "
                f"daemon's certificate (is the egress CA in its trust store? "
                f"templates built before it are not): {exc}"
            ) from None
        writer = guest.writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        upstream_tls = interception.upstream_context()
        session = HttpSession(
            (reader, writer),
            b"",
            lambda host: self._open(host, port, upstream_tls),
            lambda ex, refused, ended: self._noted(port, ex, refused, ended, "https"),
            fixed_name=name,
            transform=lambda host, headers: interception.transform(host, sb.policy, headers),
            meter=sb.meter,
        )
        await session.run()

    async def _raw(self, guest: _Guest, address: ipaddress.IPv4Address, port: int) -> None:
        sb = self.sb
        record = EgressRecord(sb.vm_id, "allowed", "tcp", None, port, str(address))
        try:
            decide.check_address(address, sb.policy, sb.fence, named=False)
            going(sb, None, address)
            upstream = await self._connect(address, port)
        except Refused as exc:
            record.verdict, record.reason = "refused", str(exc)
            self.proxy.log.add(record)
            return
        await self._spliced(record, guest.sock, upstream)

    async def _spliced(
        self, record: EgressRecord, guest: socket.socket, upstream: socket.socket
    ) -> None:
        """Splice an allowed connection, its record kept from the start, its bytes
        counted in it as they pass. (The guest's socket is closed by its :class:`_Guest`.)"""
        self.proxy.log.begin(record)
        counts = Counts()
        try:
            record.reason = await splice_sockets(guest, upstream, counts, self.sb.meter)
        finally:
            close_socket_soon(upstream)
            record.bytes_out, record.bytes_in = counts.out, counts.into
            self.proxy.log.end(record)

    def _noted(
        self,
        port: int,
        exchange: Exchange,
        refused: str | None,
        ended: str | None,
        kind: str = "http",
    ) -> None:
        self.proxy.log.add(
            EgressRecord(
                self.sb.vm_id,
                "refused" if refused else "allowed",
                kind,
                exchange.host or None,
                port,
                reason=refused or ended,
                method=exchange.method,
                path=exchange.path,
                secrets=exchange.secrets,
                bytes_out=exchange.counts.out,
                bytes_in=exchange.counts.into,
            )
        )

    def _refused(self, kind: str, host: str | None, port: int, why: str) -> None:
        self.proxy.log.add(EgressRecord(self.sb.vm_id, "refused", kind, host, port, reason=why))


async def _streams(sock: socket.socket, tls: tuple[ssl.SSLContext, str] | None) -> Stream:
    """Streams over a connected upstream socket, and over TLS of our own when ``tls``
    (context, the name to verify); the socket is closed when that fails."""
    try:
        if tls is None:
            return await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)
        opening = asyncio.open_connection(
            sock=sock, ssl=tls[0], server_hostname=tls[1], limit=STREAM_LIMIT
        )
        return await asyncio.wait_for(opening, CONNECT_SECS)
    except TimeoutError:
        sock.close()
        raise Refused(f"{tls and tls[1]}: no TLS handshake in {CONNECT_SECS:.0f} s") from None
    except ssl.SSLError as exc:
        sock.close()
        raise Refused(f"{tls and tls[1]}: TLS: {exc.reason or exc}") from None
    except OSError as exc:
        sock.close()
        raise Refused(f"{tls and tls[1]}: {exc.strerror or exc}") from None
    except BaseException:
        sock.close()
        raise


def no_delay(sock: socket.socket) -> None:
    """No Nagle: what the proxy relays goes at once. (asyncio sets TCP_NODELAY only on
    sockets whose protocol number says TCP; ours, made with protocol 0, it leaves: a
    40 ms delayed-ACK stall on every small write.)"""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def peek(sock: socket.socket, timeout: float) -> bytes:
    """The guest's first bytes, left in the socket; b"" when it said nothing in time."""
    if not await readable(sock, timeout):
        return b""
    try:
        return sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except BlockingIOError:
        return b""


async def peek_hello(sock: socket.socket) -> sniff.ClientHello:
    """The whole ClientHello, peeked (it may come in several segments): waits up to
    HELLO_SECS, polling as more arrives."""
    deadline = time.monotonic() + HELLO_SECS
    seen = -1
    while True:
        try:
            data = sock.recv(sniff.MAX_HELLO_BYTES + 64, socket.MSG_PEEK)
        except BlockingIOError:
            data = b""
        if len(data) != seen:  # parsed again only when more came
            seen = len(data)
            hello = sniff.parse_client_hello(data)
            if hello is not None:
                return hello
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ClientHello did not arrive whole in {HELLO_SECS:.0f} s")
        await asyncio.sleep(0.05)


async def _alert(conn: socket.socket) -> None:
    """Tell a refused TLS client why (access_denied), as far as it listens."""
    with contextlib.suppress(OSError):
        conn.send(sniff.access_denied_alert())
