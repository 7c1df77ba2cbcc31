"""What a guest's first bytes say: a TLS ClientHello's server name and ALPN, or an
HTTP/1.x request.

The bytes are the guest's, so this reader trusts no length in them: every
field is checked against what is left before it is read, a ClientHello may
span records but not more than :data:`MAX_HELLO_BYTES`, and anything that does
not parse is :class:`NotAHello` (the proxy then treats the connection as
plain TCP, judged by address alone). No TLS library sees the bytes before the
proxy has decided.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_HELLO_BYTES = 64 * 1024  # a ClientHello with every extension is a few KiB
MAX_HELLO_RECORDS = 16  # records a ClientHello may span (real clients: one, rarely two)
_HANDSHAKE = 0x16
_CLIENT_HELLO = 0x01
_EXT_SERVER_NAME = 0x0000
_EXT_ALPN = 0x0010
_HTTP_METHOD = re.compile(rb"^[A-Z]{3,12} ")


class NotAHello(ValueError):
    """The bytes are no TLS ClientHello (or one this reader will not follow)."""


@dataclass(frozen=True)
class ClientHello:
    server_name: str | None  # the SNI host name, as sent (not yet checked)
    alpn: tuple[str, ...]  # the protocols offered, e.g. ("h2", "http/1.1")
    size: int  # bytes of records it took


def looks_like_tls(first: bytes) -> bool:
    return len(first) >= 3 and first[0] == _HANDSHAKE and first[1] == 0x03


def looks_like_http(first: bytes) -> bool:
    return _HTTP_METHOD.match(first[:13]) is not None


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise NotAHello("a field runs past its end")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def number(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def vector(self, length_bytes: int) -> bytes:
        return self.take(self.number(length_bytes))

    @property
    def left(self) -> int:
        return len(self.data) - self.at


def handshake_bytes(data: bytes) -> tuple[bytes, int] | None:
    """The handshake message carried by the leading records of ``data`` and how many
    bytes of records that took; None when more records are needed."""
    body, at, records = bytearray(), 0, 0
    while True:
        if len(data) - at < 5:
            return None
        records += 1
        if records > MAX_HELLO_RECORDS:
            raise NotAHello(f"a ClientHello in more than {MAX_HELLO_RECORDS} records")
        if data[at] != _HANDSHAKE or data[at + 1] != 0x03:
            raise NotAHello("not a TLS handshake record")
        length = int.from_bytes(data[at + 3 : at + 5], "big")
        if length == 0 or length > 16384 + 2048:
            raise NotAHello("a record of an impossible length")
        if len(data) - at - 5 < length:
            return None
        body += data[at + 5 : at + 5 + length]
        at += 5 + length
        if len(body) >= 4:
            need = 4 + int.from_bytes(body[1:4], "big")
            if need > MAX_HELLO_BYTES:
                raise NotAHello("a ClientHello larger than forkd reads")
            if len(body) >= need:
                return bytes(body[:need]), at


def parse_client_hello(data: bytes) -> ClientHello | None:
    """The ClientHello at the start of ``data``; None when more bytes are needed;
    :class:`NotAHello` when it is none."""
    found = handshake_bytes(data)
    if found is None:
        if len(data) > MAX_HELLO_BYTES + 5 * 8:
            raise NotAHello("no ClientHello in the first bytes")
        return None
    message, size = found
    r = _Reader(message)
    if r.number(1) != _CLIENT_HELLO:
        raise NotAHello("the first handshake message is no ClientHello")
    r.take(3)  # its length: handshake_bytes checked it
    r.take(2 + 32)  # legacy version, random
    r.vector(1)  # session id
    r.vector(2)  # cipher suites
    r.vector(1)  # compression methods
    name: str | None = None
    alpn: tuple[str, ...] = ()
    if r.left:
        extensions = _Reader(r.vector(2))
        seen: set[int] = set()
        while extensions.left:
            kind, body = extensions.number(2), extensions.vector(2)
            if kind in seen:
                raise NotAHello("an extension given twice")  # RFC 8446 4.2: illegal
            seen.add(kind)
            if kind == _EXT_SERVER_NAME:
                name = _server_name(body)
            elif kind == _EXT_ALPN:
                alpn = _alpn(body)
    return ClientHello(name, alpn, size)


def _server_name(body: bytes) -> str | None:
    r = _Reader(body)
    names = _Reader(r.vector(2))
    found = None
    while names.left:
        kind, value = names.number(1), names.vector(2)
        if kind == 0:  # host_name; RFC 6066: at most one of each type
            if found is not None:
                raise NotAHello("two server names")
            try:
                found = value.decode("ascii")
            except UnicodeDecodeError:
                raise NotAHello("a server name that is not ASCII") from None
    return found


def _alpn(body: bytes) -> tuple[str, ...]:
    r = _Reader(body)
    protocols = _Reader(r.vector(2))
    out = []
    while protocols.left:
        out.append(protocols.vector(1).decode("ascii", "replace"))
    return tuple(out)


def access_denied_alert() -> bytes:
    """A fatal TLS alert, access_denied: what a refused TLS client is told (its
    library says ``alert access denied``, not a bare reset)."""
    return bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49])
