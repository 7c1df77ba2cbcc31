"""The DNS a sandbox's guest is answered: by the daemon, inside the sandbox's namespace.

The guest's resolver is ``10.0.2.3``; the namespace redirects its UDP queries to
a socket of the daemon's there. A question for a name the operator pinned
(``--egress-hosts``) is answered from the pins; a name the sandbox's policy
can never reach (denied, or not among an allow list of names only) is
NXDOMAIN, so a guest cannot carry data out in the names it looks up; anything
else is asked of the host's resolver and its answer relayed. A sandbox whose
policy lets nothing out has no DNS at all (its rules redirect nothing here).

The guest's bytes are hostile: a query is read by a bounded parser (one
question, at most 512 bytes, no compression pointers in it), at most
:data:`MAX_PENDING` of a sandbox's queries wait for the host's resolver at once
(the rest are dropped, as a busy resolver does), each for at most
:data:`UPSTREAM_SECS`. TCP queries, and queries sent to the host's resolver
straight, go nowhere: the namespace's rules let no DNS out but the daemon's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from forkd.egress.resolver import PinnedHosts
from forkd.host_names import canonical_name
from forkd.vmm.jail.egress import Egress

log = logging.getLogger(__name__)

MAX_QUERY_BYTES = 512
MAX_PENDING = 64
UPSTREAM_SECS = 3.0
PINNED_TTL = 30
TYPE_A, CLASS_IN = 1, 1
RCODE_SERVFAIL, RCODE_NXDOMAIN = 2, 3
_LABEL_BYTES = re.compile(rb"[A-Za-z0-9_-]{1,63}")


class NotAQuery(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    id: int
    name: str  # as asked, dots between labels
    qtype: int
    qclass: int
    raw: bytes  # the question section, to echo in an answer


def parse_query(data: bytes) -> Question:
    """The one question of a standard query; :class:`NotAQuery` for anything else."""
    if len(data) < 12 or len(data) > MAX_QUERY_BYTES:
        raise NotAQuery("size")
    qid, flags, qdcount, ancount, nscount, _ = struct.unpack("!6H", data[:12])
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qdcount != 1 or ancount or nscount:
        raise NotAQuery("not one standard query")
    at, labels = 12, []
    while True:
        if at >= len(data):
            raise NotAQuery("name runs past the end")
        length = data[at]
        at += 1
        if length == 0:
            break
        if length > 63 or at + length > len(data):  # (a pointer's high bits land here)
            raise NotAQuery("bad label")
        label = data[at : at + length]
        if not _LABEL_BYTES.fullmatch(label):  # a dot or anything else inside a label
            raise NotAQuery("a label of other characters")
        labels.append(label.decode("ascii"))
        at += length
    if at + 4 > len(data):
        raise NotAQuery("no type and class")
    qtype, qclass = struct.unpack("!HH", data[at : at + 4])
    return Question(qid, ".".join(labels), qtype, qclass, data[12 : at + 4])


def answer(q: Question, rcode: int = 0, addresses: tuple[ipaddress.IPv4Address, ...] = ()) -> bytes:
    """A response to ``q``: ``addresses`` as A records, or an empty one with ``rcode``."""
    flags = 0x8180 | rcode  # a response, recursion desired and available
    head = struct.pack("!6H", q.id, flags, 1, len(addresses), 0, 0)
    records = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, PINNED_TTL, 4) + a.packed for a in addresses
    )
    return head + q.raw + records


class SandboxDNS(asyncio.DatagramProtocol):
    """One sandbox's DNS socket: pins, the policy's refusals, the host's resolver."""

    def __init__(
        self, policy: Callable[[], Egress], pins: PinnedHosts, upstream: str | None
    ) -> None:
        self.policy = policy
        self.pins = pins
        self.upstream = upstream
        self.pending = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.DatagramTransport) -> None:  # type: ignore[override]  # asyncio passes a DatagramTransport (typeshed's DatagramProtocol says so too)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            q = parse_query(data)
        except NotAQuery:
            return  # not worth an answer
        reply = self._local(q)
        if reply is not None:
            self._send(reply, addr)
        elif self.pending < MAX_PENDING:
            self.pending += 1
            task = asyncio.ensure_future(self._forward(data, q, addr))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _local(self, q: Question) -> bytes | None:
        """An answer the daemon gives itself, or None: ask the host's resolver."""
        name = canonical_name(q.name)
        if name is None:
            return answer(q, RCODE_NXDOMAIN)
        if not self.policy().resolves(name):
            return answer(q, RCODE_NXDOMAIN)
        pinned = self.pins.lookup(name)
        if pinned is not None:
            return answer(q, 0, pinned if q.qtype == TYPE_A and q.qclass == CLASS_IN else ())
        if self.upstream is None:
            return answer(q, RCODE_SERVFAIL)
        return None

    async def _forward(self, data: bytes, q: Question, addr: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (str(self.upstream), 53))
            await loop.sock_sendall(sock, data)
            reply = await asyncio.wait_for(loop.sock_recv(sock, 4096), UPSTREAM_SECS)
            if len(reply) >= 2 and reply[:2] == data[:2]:
                self._send(reply, addr)
        except (OSError, TimeoutError):
            self._send(answer(q, RCODE_SERVFAIL), addr)
        finally:
            sock.close()
            self.pending -= 1

    def _send(self, reply: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)
