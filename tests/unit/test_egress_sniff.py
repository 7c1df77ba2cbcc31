"""The proxy's reader of a guest's first bytes: real ClientHellos (Python's ssl, with
server names and ALPN) give their name; anything malformed is refused, never
misread."""

from __future__ import annotations

import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkd.egress import sniff


def client_hello(server_name: str | None, alpn: list[str] | None = None) -> bytes:
    """The first flight of a real TLS client (Python's ssl), as a guest would send it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    if alpn:
        ctx.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_a_real_hello_gives_its_name_and_protocols() -> None:
    data = client_hello("api.test.example", ["h2", "http/1.1"])
    assert sniff.looks_like_tls(data) and not sniff.looks_like_http(data)
    hello = sniff.parse_client_hello(data)
    assert hello is not None
    assert hello.server_name == "api.test.example" and hello.alpn == ("h2", "http/1.1")
    assert hello.size == len(data)


def test_a_hello_without_a_name_has_none() -> None:
    hello = sniff.parse_client_hello(client_hello(None))
    assert hello is not None and hello.server_name is None


def test_a_hello_in_pieces_asks_for_more_and_across_records_is_put_together() -> None:
    data = client_hello("api.test.example")
    for cut in (1, 5, 40, len(data) - 1):
        assert sniff.parse_client_hello(data[:cut]) is None
    body = data[5:]  # the handshake split over two records, as a client may send it
    half = len(body) // 2
    split = (
        b"\x16\x03\x01"
        + half.to_bytes(2, "big")
        + body[:half]
        + b"\x16\x03\x01"
        + (len(body) - half).to_bytes(2, "big")
        + body[half:]
    )
    hello = sniff.parse_client_hello(split)
    assert hello is not None and hello.server_name == "api.test.example"
    assert hello.size == len(split)


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x00\x00",  # an empty record
        b"\x16\x03\x01\xff\xff" + b"\x00" * 70000,  # a record longer than TLS allows
        b"\x17\x03\x03\x00\x05hello",  # application data first
        b"\x16\x03\x01\x00\x04\x02\x00\x00\x00",  # a ServerHello
        b"\x16\x03\x01\x00\x08\x01\x00\x00\x04\x03\x03\x00\x00",  # fields past their end
    ],
)
def test_what_is_no_hello_is_refused(data: bytes) -> None:
    with pytest.raises(sniff.NotAHello):
        sniff.parse_client_hello(data)


def test_an_extension_given_twice_is_refused() -> None:
    data = bytearray(client_hello("a.test.example"))
    at = data.find(b"a.test.example") - 9  # the server_name extension's start
    ext = bytes(data[at : at + 4 + int.from_bytes(data[at + 2 : at + 4], "big")])
    assert ext[:2] == b"\x00\x00"
    # append a second copy of it to the extensions, fixing the three lengths it is in
    body = bytearray(bytes(data[5:]) + ext)
    ext_len_at = 5 + 4 + 2 + 32
    ext_len_at += 1 + data[ext_len_at]  # session id
    ext_len_at += 2 + int.from_bytes(data[ext_len_at : ext_len_at + 2], "big")  # suites
    ext_len_at += 1 + data[ext_len_at]  # compression
    old = int.from_bytes(data[ext_len_at : ext_len_at + 2], "big")
    body[ext_len_at - 5 : ext_len_at - 3] = (old + len(ext)).to_bytes(2, "big")
    body[1:4] = (len(body) - 4).to_bytes(3, "big")
    record = b"\x16\x03\x01" + len(body).to_bytes(2, "big") + bytes(body)
    with pytest.raises(sniff.NotAHello, match="twice"):
        sniff.parse_client_hello(record)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_parse_or_are_refused_never_misread(junk: bytes) -> None:
    data = b"\x16\x03\x01" + len(junk).to_bytes(2, "big") + junk
    try:
        hello = sniff.parse_client_hello(data)
    except sniff.NotAHello:
        return
    assert hello is None or hello.size <= len(data)


def test_http_is_told_by_its_method() -> None:
    assert sniff.looks_like_http(b"GET / HTTP/1.1\r\n")
    assert sniff.looks_like_http(b"OPTIONS * HTTP/1.1\r\n")
    assert not sniff.looks_like_http(b"SSH-2.0-OpenSSH\r\n")
    assert not sniff.looks_like_http(b"get / HTTP/1.1")


def test_a_hello_in_many_tiny_records_is_refused_without_copying_it_all() -> None:
    data = client_hello("api.test.example")
    body = data[5:]
    records = b"".join(b"\x16\x03\x01\x00\x01" + body[i : i + 1] for i in range(len(body)))
    with pytest.raises(sniff.NotAHello, match="records"):
        sniff.parse_client_hello(records)
