"""The guest's DNS questions as the daemon reads them: one standard question, labels of
host-name characters only; anything else gets no answer."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from forkd.egress import dns


def query(*labels: bytes, qid: int = 7, flags: int = 0x0100) -> bytes:
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\0"
    return struct.pack("!6H", qid, flags, 1, 0, 0, 0) + name + struct.pack("!HH", 1, 1)


def test_a_question_is_read_and_answered() -> None:
    q = dns.parse_query(query(b"api", b"test", b"example"))
    assert (q.id, q.name, q.qtype, q.qclass) == (7, "api.test.example", 1, 1)
    reply = dns.answer(q, 0, (ipaddress.IPv4Address("198.19.0.20"),))
    assert reply[:2] == b"\x00\x07" and reply[3] & 0xF == 0
    assert reply[-4:] == ipaddress.IPv4Address("198.19.0.20").packed
    assert dns.answer(q, dns.RCODE_NXDOMAIN)[3] & 0xF == 3


@pytest.mark.parametrize(
    "data",
    [
        query(b"evil.test", b"example"),  # a dot inside a label: policy and resolver differ
        query(b"a b", b"example"),
        query(b"api", flags=0x8100),  # a response, not a query
        query(b"api")[:-3],  # cut short
        b"\x00" * 11,
        query(b"x") + b"\x00" * 600,  # over 512 bytes
        struct.pack("!6H", 1, 0x0100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",  # a pointer
    ],
)
def test_what_is_no_plain_question_is_refused(data: bytes) -> None:
    with pytest.raises(dns.NotAQuery):
        dns.parse_query(data)
