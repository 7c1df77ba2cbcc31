"""Output events from proc_read answers: runs joined, text or base64, cut characters held."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any, cast

import pytest

from forkd import agent_wire as wire
from forkd.controller.services import process_output
from forkd.controller.services.process_output import OutputEvents, ReadAnswer
from forkd.errors import GuestError


def untrusted(body: Mapping[str, object]) -> wire.ProcReadAnswer:
    """``body`` as a guest's proc_read answer. ReadAnswer.parse takes it as untrusted, and
    the bodies here leave keys out, or are malformed, on purpose."""
    return cast(wire.ProcReadAnswer, body)


def answer(*chunks: tuple[str, int, bytes], eof: bool = False, **kw: Any) -> ReadAnswer:
    raw = [{"stream": s, "offset": o, "data": base64.b64encode(d).decode()} for s, o, d in chunks]
    end = max((o + len(d) for _, o, d in chunks), default=kw.pop("next_offset", 0))
    body = {
        "chunks": raw,
        "next_offset": end,
        "gap": None,
        "running": not eof,
        "exit_code": 0 if eof else None,
        "eof": eof,
        **kw,
    }
    return ReadAnswer.parse(untrusted(body), 0)


def plain(events: OutputEvents, ans: ReadAnswer) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for e in events.of(ans):
        body = e.body.model_dump(by_alias=True) if e.body else None
        out.append((e.event, body))
    return out


def test_adjacent_chunks_of_a_stream_are_one_event() -> None:
    got = plain(
        OutputEvents(),
        answer(("stdout", 0, b"a"), ("stdout", 1, b"b"), ("stderr", 2, b"c"), ("stdout", 3, b"d")),
    )
    assert [(e, b["data"], b["offset"], b["next_offset"]) for e, b in got] == [
        ("stdout", "ab", 0, 2),
        ("stderr", "c", 2, 3),
        ("stdout", "d", 3, 4),
    ]


def test_a_character_cut_between_answers_is_held_until_whole() -> None:
    events = OutputEvents()
    e_acute = "é".encode()
    first = plain(events, answer(("stdout", 0, b"caf" + e_acute[:1])))
    assert first == [
        ("stdout", {"data": "caf", "encoding": "utf-8", "offset": 0, "next_offset": 3})
    ]
    second = plain(events, answer(("stdout", 4, e_acute[1:] + b"!")))
    assert second == [
        ("stdout", {"data": "é!", "encoding": "utf-8", "offset": 3, "next_offset": 6})
    ]


def test_a_held_start_that_is_not_continued_goes_out_as_base64() -> None:
    events = OutputEvents()
    plain(events, answer(("stdout", 0, b"x\xc3")))
    got = plain(events, answer(("stderr", 2, b"e"), eof=True))
    assert got[0] == (
        "stdout",
        {
            "data": base64.b64encode(b"\xc3").decode(),
            "encoding": "base64",
            "offset": 1,
            "next_offset": 2,
        },
    )
    assert got[1][0] == "stderr" and got[-1] == ("exit", {"exit_code": 0})


def test_a_gap_comes_first() -> None:
    got = plain(OutputEvents(), answer(("stdout", 10, b"z"), gap={"from": 0, "to": 10}))
    assert got[0] == ("gap", {"from": 0, "to": 10})


@pytest.mark.parametrize(
    "body",
    [
        {"chunks": [{"stream": "stdin", "offset": 0, "data": ""}], "next_offset": 0, "eof": False},
        {
            "chunks": [{"stream": "stdout", "offset": 0, "data": "!!"}],
            "next_offset": 0,
            "eof": False,
        },
        {"chunks": [], "next_offset": -1, "eof": False},
        {"chunks": [], "next_offset": "5", "eof": False},
        {"chunks": "no", "next_offset": 0, "eof": False},
        {"chunks": [], "eof": False},
        {"chunks": [], "next_offset": 3, "eof": False, "gap": {"from": 0}},
    ],
)
def test_a_malformed_answer_is_a_guest_error(body: dict[str, Any]) -> None:
    with pytest.raises(GuestError):
        ReadAnswer.parse(untrusted(body), 0)


def test_output_never_goes_back() -> None:
    with pytest.raises(GuestError, match="went back"):
        ReadAnswer.parse(untrusted({"chunks": [], "next_offset": 3, "eof": False}), 5)


def test_nul_bytes_go_as_base64_where_json_would_escape_them_six_fold() -> None:
    zeros = plain(OutputEvents(), answer(("stdout", 0, bytes(3000))))
    assert [(b["encoding"], base64.b64decode(b["data"])) for _, b in zeros] == [
        ("base64", bytes(3000))
    ]

    text = b"line of text with one NUL \0 in it\n" * 20
    mixed = plain(OutputEvents(), answer(("stdout", 0, text)))
    assert [(b["encoding"], b["data"]) for _, b in mixed] == [("utf-8", text.decode())]


def test_raw_output_is_cut_by_the_chunks_sizes() -> None:
    body = {
        "chunks": [
            {"stream": "stdout", "offset": 5, "size": 3},
            {"stream": "stderr", "offset": 8, "size": 2},
        ],
        "raw": b"abcde",
        "next_offset": 10,
        "gap": None,
        "eof": False,
    }
    parsed = ReadAnswer.parse(untrusted(body), 5)
    assert [(c.stream, c.offset, c.data) for c in parsed.chunks] == [
        ("stdout", 5, b"abc"),
        ("stderr", 8, b"de"),
    ]


@pytest.mark.parametrize("raw", [b"abcdef", b"abcd", "abcde"], ids=["longer", "shorter", "str"])
def test_raw_output_that_does_not_match_the_sizes_is_a_guest_error(raw: object) -> None:
    body = {
        "chunks": [{"stream": "stdout", "offset": 0, "size": 5}],
        "raw": raw,
        "next_offset": 5,
        "gap": None,
        "eof": False,
    }
    with pytest.raises(GuestError, match="malformed proc_read answer"):
        ReadAnswer.parse(untrusted(body), 0)


def test_an_answer_of_more_chunks_than_the_agents_ring_holds_is_refused() -> None:
    """Each chunk may become an event: a guest must not hand the loop 100,000 of them."""
    n = process_output.MAX_CHUNKS + 1
    body: dict[str, Any] = {
        "chunks": [{"stream": "stdout", "offset": 2 * i, "size": 1} for i in range(n)],
        "raw": b"x" * n,
        "next_offset": 2 * n,
        "gap": None,
        "eof": False,
    }
    with pytest.raises(GuestError, match="more than 16384 chunks"):
        ReadAnswer.parse(untrusted(body), 0)
    body["chunks"] = body["chunks"][:-1]
    body["raw"] = b"x" * (n - 1)
    assert len(ReadAnswer.parse(untrusted(body), 0).chunks) == n - 1  # as many as the ring holds


@pytest.mark.parametrize("second", [0, 2], ids=["again", "overlapping"])
def test_chunks_that_tell_the_same_bytes_twice_are_refused(second: int) -> None:
    body = {
        "chunks": [
            {"stream": "stdout", "offset": 0, "size": 3},
            {"stream": "stdout", "offset": second, "size": 3},
        ],
        "raw": b"abcdef",
        "next_offset": 6,
        "gap": None,
        "eof": False,
    }
    with pytest.raises(GuestError, match="overlaps"):
        ReadAnswer.parse(untrusted(body), 0)
