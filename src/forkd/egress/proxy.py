"""The egress proxy: one asyncio server in the daemon serving a listener inside each
sandbox's namespace.

The namespace's nftables rules redirect every TCP connection the guest opens to
``10.0.2.2:15001`` (:mod:`forkd.vmm.jail.network`); the proxy reads where it
was going (``SO_ORIGINAL_DST``) and its first bytes, decides (:mod:`.decide`),
and opens the upstream connection from a socket made inside the same
namespace, so what fences sandboxes in on the host applies to it unchanged.

- TLS: the ClientHello's server name decides, and the bytes pass through
  untouched (never decrypted).
- HTTP: each request's Host decides (:mod:`.http`).
- Anything else (or a guest that says nothing for a second, as clients of
  servers that speak first do): the original address, by the policy's
  addresses and CIDRs only.

Per sandbox at most :data:`MAX_CONNECTIONS` connections are open at once, holding
at most its :class:`~.meter.Meter`'s share of bytes in the daemon (and moving no
faster than its rate, when the operator set one); a first request has
:data:`~.http.HEAD_SECS` to arrive; a connection idle both ways for
:data:`~.splice.IDLE_SECS` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from typing import Protocol

from forkd import limits
from forkd.egress import decide, sniff
from forkd.egress.decide import Fence, Refused
from forkd.egress.dns import SandboxDNS
from forkd.egress.http import Exchange, Headers, HttpSession, Stream
from forkd.egress.meter import HELD_BYTES, Meter
from forkd.egress.records import EgressLog, EgressRecord
from forkd.egress.resolver import Resolver
from forkd.egress.splice import Counts, close_socket_soon, close_soon, readable, splice_sockets
from forkd.vmm.jail import netns_ops
from forkd.vmm.jail.addresses import DNS_PORT, GATEWAY_IP, PROXY_PORT
from forkd.vmm.jail.egress import Egress
from forkd.vmm.jail.network import SandboxNet

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512  # open at once per sandbox; more are closed as they come
# ... and for all sandboxes at once, at most a quarter of the descriptors this process
# may open (each connection holds two): a flood of guests cannot starve the daemon.
MAX_ALL_CONNECTIONS = 65536
FIRST_BYTES_SECS = 1.0  # a guest silent this long speaks raw TCP (the server first)
CONNECT_SECS = 10.0
SO_ORIGINAL_DST = 80
SOCKET_BATCH = 8  # upstream sockets made inside a namespace at a time
PEEK_BYTES = 16 * 1024
HELLO_SECS = 10.0  # a ClientHello must arrive whole within this
# The guest's side of an intercepted handshake: under TCG on a loaded host a guest's
# TLS library (git's gnutls) took over 10 s to finish it.
GUEST_HANDSHAKE_SECS = 30.0
STREAM_LIMIT = 64 * 1024  # what a stream (HTTP served, TLS terminated) reads ahead


def original_destination(sock: socket.socket) -> tuple[ipaddress.IPv4Address, int]:
    """Where the guest's connection was going before the namespace redirected it."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!2xH4s", raw)
    return ipaddress.IPv4Address(address), port


class _Sockets:
    """Upstream sockets made inside one namespace, a batch at a time (each batch costs
    a thread that enters it)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._stock: list[socket.socket] = []
        self._lock = asyncio.Lock()

    async def take(self) -> socket.socket:
        async with self._lock:
            if not self._stock:
                self._stock = await asyncio.to_thread(
                    netns_ops.run_inside,
                    self.netns,
                    lambda: [
                        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                        for _ in range(SOCKET_BATCH)
                    ],
                )
            return self._stock.pop()

    def close(self) -> None:
        for sock in self._stock:
            sock.close()
        self._stock.clear()


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


@dataclass
class _Sandbox:
    vm_id: str
    netns: str
    policy: Egress
    fence: Fence
    sockets: _Sockets
    meter: Meter
    listener: socket.socket | None = None
    accepting: asyncio.Task[None] | None = None
    dns: asyncio.DatagramTransport | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Where each open connection goes (the name it was allowed by, else its address):
    # a new policy closes those it denies.
    going: dict[asyncio.Task[None], tuple[str | None, ipaddress.IPv4Address | None]] = field(
        default_factory=dict
    )


class Interception(Protocol):
    """What terminates TLS for hosts with rules or secrets (:mod:`.intercept`)."""

    def wanted(self, name: str, policy: Egress) -> bool: ...

    async def server_context(self, name: str) -> ssl.SSLContext: ...

    def upstream_context(self) -> ssl.SSLContext: ...

    def transform(
        self, name: str, policy: Egress, headers: Headers
    ) -> tuple[Headers, list[str]]: ...


class EgressProxy:
    """Attached to each namespace as it is made (:class:`~forkd.vmm.jail.network.
    EgressListener`), released as it goes."""

    def __init__(
        self,
        resolver: Resolver,
        sandbox_cidr: str,
        log_: EgressLog | None = None,
        interception: Interception | None = None,
        dns_upstream: str | None = None,
        held_bytes: int = HELD_BYTES,
        rate: int | None = None,
    ) -> None:
        self.resolver = resolver
        self.dns_upstream = dns_upstream  # the host's resolver, for the guests' DNS
        self.sandbox_cidr = sandbox_cidr
        self.log = log_ or EgressLog()
        self.interception = interception
        self._sandboxes: dict[str, _Sandbox] = {}  # by namespace name
        self.open = 0  # connections served now, every sandbox's
        # Read once, not at every accept (forkd serve raised the limit before).
        self.max_open = max(64, limits.descriptor_share(MAX_ALL_CONNECTIONS))
        self.held_bytes = held_bytes  # each sandbox's share (.meter)
        self.rate = rate  # bytes a second each way, each sandbox; None: unbounded

    # ------------------------------------------------------------ namespaces

    async def attach(
        self, net: SandboxNet, vm_id: str, policy: Egress, host_nets: list[ipaddress.IPv4Network]
    ) -> None:
        """Listen inside ``net``'s namespace for its guest's connections."""
        self.release(net.netns)
        listener, dns_sock = await asyncio.to_thread(netns_ops.run_inside, net.netns, _sockets)
        sb = _Sandbox(
            vm_id,
            net.netns,
            policy,
            Fence.of(self.sandbox_cidr, host_nets),
            _Sockets(net.netns),
            Meter(self.held_bytes, self.rate),
            listener,
        )
        self._sandboxes[net.netns] = sb
        try:
            loop = asyncio.get_running_loop()
            sb.dns, _ = await loop.create_datagram_endpoint(
                lambda: SandboxDNS(lambda: sb.policy, self.resolver.pins, self.dns_upstream),
                sock=dns_sock,
            )
        except BaseException:
            dns_sock.close()
            self.release(net.netns)
            raise
        sb.accepting = asyncio.ensure_future(self._accept(sb))

    def release(self, netns: str) -> None:
        """Stop listening in ``netns`` and cut its connections (its namespace goes: no
        socket of ours may keep it alive)."""
        sb = self._sandboxes.pop(netns, None)
        if sb is None:
            return
        if sb.accepting is not None:
            sb.accepting.cancel()
        if sb.listener is not None:
            sb.listener.close()
        if sb.dns is not None:
            sb.dns.close()
        for task in sb.tasks:
            task.cancel()
        sb.sockets.close()

    def set_policy(self, vm_id: str, policy: Egress) -> int:
        """New connections of ``vm_id``'s guest are judged by ``policy`` from now on, and
        its open connections that ``policy`` denies are closed; how many were."""
        closed = 0
        for sb in self._sandboxes.values():
            if sb.vm_id != vm_id:
                continue
            sb.policy = policy
            for task, (name, address) in list(sb.going.items()):
                if not _still_allowed(policy, sb.fence, name, address):
                    task.cancel()
                    closed += 1
        return closed

    def meter_of(self, vm_id: str) -> Meter | None:
        """``vm_id``'s share of the proxy, while it is attached."""
        return next((sb.meter for sb in self._sandboxes.values() if sb.vm_id == vm_id), None)

    def policy_of(self, vm_id: str) -> Egress | None:
        return next((sb.policy for sb in self._sandboxes.values() if sb.vm_id == vm_id), None)

    async def close(self) -> None:
        for netns in list(self._sandboxes):
            self.release(netns)

    # ------------------------------------------------------------ connections

    async def _accept(self, sb: _Sandbox) -> None:
        assert sb.listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sb.listener)
            except OSError as exc:  # out of descriptors, or the listener closed
                log.warning("egress proxy of %s cannot accept: %s", sb.vm_id, exc)
                await asyncio.sleep(0.1)
                continue
            if len(sb.tasks) >= MAX_CONNECTIONS or self.open >= self.max_open:
                conn.close()
                what = "this sandbox's" if len(sb.tasks) >= MAX_CONNECTIONS else "all sandboxes'"
                self._refused(sb, "tcp", None, 0, f"too many connections open ({what})")
                continue
            self.open += 1
            task = asyncio.ensure_future(self._serve(sb, conn))
            sb.tasks.add(task)
            task.add_done_callback(sb.tasks.discard)
            task.add_done_callback(functools.partial(_gone, self, sb))

    async def _serve(self, sb: _Sandbox, conn: socket.socket) -> None:
        """Decide by what the guest's first bytes say, read without taking them (peeked):
        a connection passed through or intercepted starts from its first byte."""
        conn.setblocking(False)
        _no_delay(conn)
        guest = _Guest(conn)
        try:
            address, port = original_destination(conn)
            first = await peek(conn, FIRST_BYTES_SECS)
            if sniff.looks_like_tls(first):
                await self._tls(sb, guest, address, port)
            elif sniff.looks_like_http(first):
                await self._http(sb, guest, address, port)
            else:
                await self._raw(sb, guest, address, port)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError) as exc:
            log.debug("egress %s: %s", sb.vm_id, exc)
        except Exception:  # a bug of the proxy's: said, and only this connection ends
            log.exception("egress proxy of %s: a connection failed", sb.vm_id)
        finally:
            guest.close()

    async def _http(
        self, sb: _Sandbox, guest: _Guest, address: ipaddress.IPv4Address, port: int
    ) -> None:
        """Plain HTTP: each request judged by its Host (by ``address`` without one)."""
        session = HttpSession(
            await guest.streams(),
            b"",
            lambda name: self._open(sb, name, port),
            lambda ex, refused, ended: self._noted(sb, port, ex, refused, ended),
            default_host=str(address),
            meter=sb.meter,
        )
        await session.run()

    async def _connect(
        self, sb: _Sandbox, address: ipaddress.IPv4Address, port: int
    ) -> socket.socket:
        sock = await sb.sockets.take()
        try:
            sock.setblocking(False)
            _no_delay(sock)
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

    async def _open(
        self, sb: _Sandbox, name: str, port: int, tls: ssl.SSLContext | None = None
    ) -> Stream:
        """:meth:`_open_socket`, as streams (over TLS of our own when ``tls``)."""
        sock = await self._open_socket(sb, name, port)
        return await _streams(sock, (tls, name) if tls is not None else None)

    async def _open_socket(self, sb: _Sandbox, name: str, port: int) -> socket.socket:
        """An upstream connection for ``name`` as a guest gave it: an address literal is
        judged as an address, anything else as a name."""
        literal = decide.ip_literal(name)
        if literal is not None:
            decide.check_address(literal, sb.policy, sb.fence, named=False)
            _going(sb, None, literal)
            return await self._connect(sb, literal, port)
        name = decide.checked_name(name)
        _going(sb, name, None)  # before the first wait: a policy change meanwhile sees it
        address = await decide.destination(name, sb.policy, sb.fence, self.resolver)
        _going(sb, name, address)
        sock = await self._connect(sb, address, port)
        if not sb.policy.allows_name(name):  # changed while it resolved or connected
            sock.close()
            raise Refused(f"{name} is not allowed by the sandbox's network policy")
        return sock

    async def _tls(
        self, sb: _Sandbox, guest: _Guest, address: ipaddress.IPv4Address, port: int
    ) -> None:
        conn = guest.sock
        try:
            hello = await peek_hello(conn)
        except (sniff.NotAHello, TimeoutError) as exc:
            await _alert(conn)
            self._refused(sb, "tls", None, port, f"no readable ClientHello: {exc}")
            return
        record = EgressRecord(sb.vm_id, "allowed", "tls", hello.server_name or str(address), port)
        try:
            if hello.server_name is None:
                decide.check_address(address, sb.policy, sb.fence, named=False)
                _going(sb, None, address)
                upstream = await self._connect(sb, address, port)
            else:
                literal = decide.ip_literal(hello.server_name)
                record.host = str(literal) if literal else decide.checked_name(hello.server_name)
                if literal is None and self._intercepted(sb, record.host):
                    if not sb.policy.allows_name(record.host):  # no certificate minted for it
                        raise Refused(
                            f"{record.host} is not allowed by the sandbox's network policy"
                        )
                    await self._intercept(sb, guest, record.host, hello, port)
                    return
                upstream = await self._open_socket(sb, record.host, port)
        except Refused as exc:
            await _alert(conn)
            record.verdict, record.reason = "refused", str(exc)
            self.log.add(record)
            return
        record.address = str(upstream.getpeername()[0])
        await self._spliced(sb, record, guest.sock, upstream)

    def _intercepted(self, sb: _Sandbox, name: str) -> bool:
        return self.interception is not None and self.interception.wanted(name, sb.policy)

    async def _intercept(
        self, sb: _Sandbox, guest: _Guest, name: str, hello: sniff.ClientHello, port: int
    ) -> None:
        """Terminate the guest's TLS with a certificate for ``name`` minted by the
        daemon's CA, and serve its requests as HTTP/1.1 to ``name`` over a TLS
        connection of our own, verified; substitutions by :meth:`Interception.transform`."""
        assert self.interception is not None
        interception = self.interception
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
            lambda host: self._open(sb, host, port, upstream_tls),
            lambda ex, refused, ended: self._noted(sb, port, ex, refused, ended, "https"),
            fixed_name=name,
            transform=lambda host, headers: interception.transform(host, sb.policy, headers),
            meter=sb.meter,
        )
        await session.run()

    async def _raw(
        self, sb: _Sandbox, guest: _Guest, address: ipaddress.IPv4Address, port: int
    ) -> None:
        record = EgressRecord(sb.vm_id, "allowed", "tcp", None, port, str(address))
        try:
            decide.check_address(address, sb.policy, sb.fence, named=False)
            _going(sb, None, address)
            upstream = await self._connect(sb, address, port)
        except Refused as exc:
            record.verdict, record.reason = "refused", str(exc)
            self.log.add(record)
            return
        await self._spliced(sb, record, guest.sock, upstream)

    async def _spliced(
        self, sb: _Sandbox, record: EgressRecord, guest: socket.socket, upstream: socket.socket
    ) -> None:
        """Splice an allowed connection, its record kept from the start, its bytes
        counted in it as they pass. (The guest's socket is closed by its :class:`_Guest`.)"""
        self.log.begin(record)
        counts = Counts()
        try:
            record.reason = await splice_sockets(guest, upstream, counts, sb.meter)
        finally:
            close_socket_soon(upstream)
            record.bytes_out, record.bytes_in = counts.out, counts.into
            self.log.end(record)

    def _noted(
        self,
        sb: _Sandbox,
        port: int,
        exchange: Exchange,
        refused: str | None,
        ended: str | None,
        kind: str = "http",
    ) -> None:
        self.log.add(
            EgressRecord(
                sb.vm_id,
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

    def _refused(self, sb: _Sandbox, kind: str, host: str | None, port: int, why: str) -> None:
        self.log.add(EgressRecord(sb.vm_id, "refused", kind, host, port, reason=why))


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


def _no_delay(sock: socket.socket) -> None:
    """No Nagle: what the proxy relays goes at once. (asyncio sets TCP_NODELAY only on
    sockets whose protocol number says TCP; ours, made with protocol 0, it leaves: a
    40 ms delayed-ACK stall on every small write.)"""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _gone(proxy: EgressProxy, sb: _Sandbox, task: asyncio.Task[None]) -> None:
    sb.going.pop(task, None)
    proxy.open -= 1


def _going(sb: _Sandbox, name: str | None, address: ipaddress.IPv4Address | None) -> None:
    """Note where the current connection goes (by name when a name allowed it)."""
    task = asyncio.current_task()
    if task is not None:
        sb.going[task] = (name, address)


def _still_allowed(
    policy: Egress, fence: Fence, name: str | None, address: ipaddress.IPv4Address | None
) -> bool:
    """Does ``policy`` still let an open connection be: one allowed by ``name`` (its
    address then only against the policy's address denials), or by its address?"""
    if name is not None and not policy.allows_name(name):
        return False
    if address is None:
        return not policy.shut
    try:
        decide.check_address(address, policy, fence, named=name is not None)
    except Refused:
        return False
    return True


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


def _sockets() -> tuple[socket.socket, socket.socket]:
    """Made on one thread inside the namespace: the proxy's listener and DNS socket."""
    listener = _listening_socket()
    try:
        dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            dns.bind((GATEWAY_IP, DNS_PORT))
            dns.setblocking(False)
        except BaseException:
            dns.close()
            raise
    except BaseException:
        listener.close()
        raise
    return listener, dns


def _listening_socket() -> socket.socket:
    """Made on a thread inside the namespace: the proxy's listener there."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((GATEWAY_IP, PROXY_PORT))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
