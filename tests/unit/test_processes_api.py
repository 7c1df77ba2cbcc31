"""The processes routes (/v1/sandboxes/{id}/processes) of the real app over the fake driver.

The app runs under a real uvicorn on loopback, so output streams are real
Server-Sent Events over a socket, with its flow control; the fake guest
plays the agent's processes (tests/unit/fake_processes.py).
"""

from __future__ import annotations

import base64
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import ServerSentEvent, connect_sse

from tests.unit.conftest import Server
from tests.unit.fakes import FakeVM

Events = list[ServerSentEvent]


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        yield c


@pytest.fixture
def sid(http: httpx.Client) -> str:
    assert http.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    r = http.post("/v1/sandboxes", json={"snapshot_tag": "py"})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


def vm_of(server: Server, sandbox_id: str) -> FakeVM:
    return next(vm for vm in server.driver.vms if vm.id == sandbox_id)


def start(http: httpx.Client, sid: str, cmd: Any, **body: Any) -> dict[str, Any]:
    r = http.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": cmd, **body})
    assert r.status_code == 201, r.text
    return r.json()


def events(http: httpx.Client, sid: str, pid: int, **params: Any) -> Events:
    url = f"/v1/sandboxes/{sid}/processes/{pid}/output"
    headers = params.pop("headers", {})
    with connect_sse(http, "GET", url, params=params, headers=headers) as source:
        assert source.response.headers["content-type"].startswith("text/event-stream")
        return list(source.iter_sse())


def text_of(stream: Events, name: str = "stdout") -> str:
    return "".join(json.loads(e.data)["data"] for e in stream if e.event == name)


def wait_exit(http: httpx.Client, sid: str, pid: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while (info := http.get(f"/v1/sandboxes/{sid}/processes/{pid}").json())["running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return info


# -- start, list, inspect -----------------------------------------------------------


def test_start_list_and_inspect(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["sleep", "30"])
    assert info["cmd"] == ["sleep", "30"] and info["running"] and info["exit_code"] is None
    assert not info["pty"] and not info["stdin"] and info["started_at"] > 0
    shell = start(http, sid, "echo hi")
    assert shell["cmd"] == ["/bin/sh", "-c", "echo hi"]
    listed = http.get(f"/v1/sandboxes/{sid}/processes").json()
    assert [p["pid"] for p in listed] == [info["pid"], shell["pid"]]
    got = http.get(f"/v1/sandboxes/{sid}/processes/{info['pid']}").json()
    assert got["pid"] == info["pid"] and got["running"]
    assert wait_exit(http, sid, shell["pid"])["exit_code"] == 0


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"cmd": []}, "cmd"),
        ({"cmd": ""}, "cmd"),
        ({"cmd": ["a", 1]}, "cmd"),
        ({"cmd": ["sleep", "1"], "stdin": 1}, "stdin"),
        ({"cmd": ["sleep", "1"], "pty": {"cols": 0, "rows": 24}}, "pty"),
        ({"cmd": ["sleep", "1"], "timeout_s": 0}, "timeout_s"),
        ({"cmd": ["nosuch"]}, "No such file"),
    ],
)
def test_a_bad_start_is_a_400(http: httpx.Client, sid: str, body: Any, problem: str) -> None:
    r = http.post(f"/v1/sandboxes/{sid}/processes", json=body)
    assert r.status_code == 400, r.text
    assert problem in r.json()["error"]
    assert http.get(f"/v1/sandboxes/{sid}/processes").json() == []


def test_unknown_sandbox_or_pid_is_a_404(http: httpx.Client, sid: str) -> None:
    assert http.get("/v1/sandboxes/sb-nope/processes").status_code == 404
    r = http.post("/v1/sandboxes/sb-nope/processes", json={"cmd": ["true"]})
    assert r.status_code == 404
    base = f"/v1/sandboxes/{sid}/processes/4242"
    assert http.get(base).status_code == 404
    assert http.get(f"{base}/output").status_code == 404
    assert http.post(f"{base}/stdin", json={"data": "x"}).status_code == 404
    assert http.post(f"{base}/signal", json={"signal": "TERM"}).status_code == 404
    assert http.post(f"{base}/resize", json={"cols": 80, "rows": 24}).status_code == 404
    assert http.get(f"/v1/sandboxes/{sid}/processes/0").status_code == 400


def test_too_many_processes_is_a_429(http: httpx.Client, sid: str) -> None:
    for _ in range(64):
        start(http, sid, ["sleep", "30"])
    r = http.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["sleep", "30"]})
    assert r.status_code == 429 and "processes" in r.json()["error"]


def test_timeout_s_kills_with_124(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["sleep", "30"], timeout_s=0.1)
    assert wait_exit(http, sid, info["pid"])["exit_code"] == 124


# -- output -------------------------------------------------------------------------


def test_output_streams_to_the_exit(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["count", "5", "0.05"])
    stream = events(http, sid, info["pid"])
    assert [e.event for e in stream][-1] == "exit"
    assert json.loads(stream[-1].data) == {"exit_code": 0}
    assert text_of(stream) == "1\n2\n3\n4\n5\n"
    data = [json.loads(e.data) for e in stream if e.event == "stdout"]
    assert data[0]["offset"] == 0 and data[0]["encoding"] == "utf-8"
    for before, after in itertools.pairwise(data):  # no byte lost or repeated
        assert after["offset"] == before["next_offset"]
    assert [int(e.id) for e in stream if e.event == "stdout"] == [d["next_offset"] for d in data]


def test_output_arrives_as_it_is_written(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["count", "3", "0.5"])
    url = f"/v1/sandboxes/{sid}/processes/{info['pid']}/output"
    t0 = time.monotonic()
    with connect_sse(http, "GET", url) as source:
        sse = source.iter_sse()
        first = next(sse)
        first_at = time.monotonic() - t0
        rest = list(sse)
    assert json.loads(first.data)["data"] == "1\n"
    assert first_at < 0.4 < time.monotonic() - t0  # long before the end
    assert rest[-1].event == "exit"


def test_stderr_and_exit_code(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["exit", "3"])
    stream = events(http, sid, info["pid"])
    assert text_of(stream, "stderr") == "exit 3\n" and text_of(stream) == ""
    assert json.loads(stream[-1].data) == {"exit_code": 3}


def test_follow_false_returns_what_is_there(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["count", "100", "0.05"])
    time.sleep(0.2)
    stream = events(http, sid, info["pid"], follow="false")
    assert "exit" not in [e.event for e in stream]
    assert text_of(stream).startswith("1\n2\n")
    done = start(http, sid, ["echo", "x"])
    wait_exit(http, sid, done["pid"])
    stream = events(http, sid, done["pid"], follow="false")
    assert [e.event for e in stream] == ["stdout", "exit"]


def test_reconnecting_at_an_offset_resumes_without_loss(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["count", "4", "0.01"])
    whole = events(http, sid, info["pid"])
    assert text_of(whole) == "1\n2\n3\n4\n"
    second = json.loads([e for e in whole if e.event == "stdout"][1].data)
    rest = events(http, sid, info["pid"], offset=second["offset"])
    assert text_of(rest) == text_of(whole)[second["offset"] :]
    by_header = events(http, sid, info["pid"], headers={"Last-Event-ID": str(second["offset"])})
    assert text_of(by_header) == text_of(rest)
    end = whole[-2].id
    assert [e.event for e in events(http, sid, info["pid"], offset=end)] == ["exit"]
    r = http.get(f"/v1/sandboxes/{sid}/processes/{info['pid']}/output", params={"offset": 999})
    assert r.status_code == 400 and "past the end" in r.json()["error"]


def test_a_gap_is_reported_never_skipped(server: Server, http: httpx.Client, sid: str) -> None:
    vm_of(server, sid).processes.ring_bytes = 6  # three lines of "N\n"
    info = start(http, sid, ["count", "9", "0"])
    wait_exit(http, sid, info["pid"])
    stream = events(http, sid, info["pid"])
    assert stream[0].event == "gap"
    assert json.loads(stream[0].data) == {"from": 0, "to": 12}
    assert text_of(stream) == "7\n8\n9\n"
    assert json.loads(stream[1].data)["offset"] == 12


def test_binary_output_is_base64(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["hex", "ff00fe"])
    [data, _exit] = events(http, sid, info["pid"])
    body = json.loads(data.data)
    assert body["encoding"] == "base64" and base64.b64decode(body["data"]) == b"\xff\x00\xfe"


def test_a_terminal_streams_pty_and_resizes(server: Server, http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["echo", "hi"], pty={"cols": 80, "rows": 24})
    assert info["pty"] and info["stdin"]
    assert text_of(events(http, sid, info["pid"]), "pty") == "hi\n"
    shell = start(http, sid, ["cat"], pty={"cols": 80, "rows": 24})
    url = f"/v1/sandboxes/{sid}/processes/{shell['pid']}/resize"
    assert http.post(url, json={"cols": 120, "rows": 40}).status_code == 204
    assert vm_of(server, sid).processes.procs[shell["pid"]].size == (120, 40)
    plain = start(http, sid, ["sleep", "30"])
    r = http.post(
        f"/v1/sandboxes/{sid}/processes/{plain['pid']}/resize", json={"cols": 120, "rows": 40}
    )
    assert r.status_code == 400 and "has no pty" in r.json()["error"]  # the agent's words
    assert http.post(url, json={"cols": 1001, "rows": 40}).status_code == 400


def test_an_agent_failure_mid_stream_ends_it_with_an_error_event(
    server: Server, http: httpx.Client, sid: str
) -> None:
    info = start(http, sid, ["sleep", "30"])
    vm_of(server, sid).fail = "proc_read"
    stream = events(http, sid, info["pid"])
    assert [e.event for e in stream] == ["error"]
    error = json.loads(stream[0].data)
    assert "proc_read" in error["error"] and error["status"] == 502


def test_a_sandbox_dying_mid_stream_ends_it_with_a_409_event(
    server: Server, http: httpx.Client, sid: str
) -> None:
    info = start(http, sid, ["count", "1000", "0.05"])
    url = f"/v1/sandboxes/{sid}/processes/{info['pid']}/output"
    with connect_sse(http, "GET", url) as source:
        sse = source.iter_sse()
        assert next(sse).event == "stdout"
        vm_of(server, sid).alive = False  # its QEMU exited
        rest = list(sse)
    error = json.loads(rest[-1].data)
    assert rest[-1].event == "error" and error["status"] == 409 and "dead" in error["error"]


def test_a_followed_stream_waits_out_a_pause_and_goes_on(
    server: Server, http: httpx.Client, sid: str
) -> None:
    info = start(http, sid, ["count", "8", "0.1"])
    url = f"/v1/sandboxes/{sid}/processes/{info['pid']}/output"

    def resume_later() -> None:
        time.sleep(1.0)
        with httpx.Client(base_url=server.url, headers=http.headers) as other:
            assert other.post(f"/v1/sandboxes/{sid}/resume").status_code == 200

    with connect_sse(http, "GET", url) as source:
        sse = source.iter_sse()
        first = next(sse)
        assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        resumer = threading.Thread(target=resume_later)
        resumer.start()
        rest = list(sse)
        resumer.join()
    assert rest[-1].event == "exit", rest[-1]
    assert "error" not in [e.event for e in rest]
    assert text_of([first, *rest]) == "".join(f"{i}\n" for i in range(1, 9))  # none lost


# -- stdin and signals ----------------------------------------------------------------


def test_stdin_feeds_cat(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["cat"], stdin=True)
    base = f"/v1/sandboxes/{sid}/processes/{info['pid']}"
    assert http.post(f"{base}/stdin", json={"data": "héllo\n"}).json() == {"written": 7}
    raw = base64.b64encode(b"\xffbin").decode()
    r = http.post(f"{base}/stdin", json={"data": raw, "encoding": "base64", "eof": True})
    assert r.json() == {"written": 4}
    stream = events(http, sid, info["pid"])
    chunks = [json.loads(e.data) for e in stream if e.event == "stdout"]
    assert (
        b"".join(
            base64.b64decode(c["data"]) if c["encoding"] == "base64" else c["data"].encode()
            for c in chunks
        )
        == "héllo\n".encode() + b"\xffbin"
    )
    assert json.loads(stream[-1].data) == {"exit_code": 0}
    r = http.post(f"{base}/stdin", json={"data": "late"})
    assert r.status_code == 409, r.text
    for bad in ("!", "é==="):
        r = http.post(f"{base}/stdin", json={"data": bad, "encoding": "base64"})
        assert r.status_code == 400 and "base64" in r.json()["error"]


def test_stdin_of_a_process_without_it_is_a_400(http: httpx.Client, sid: str) -> None:
    info = start(http, sid, ["sleep", "30"])
    r = http.post(f"/v1/sandboxes/{sid}/processes/{info['pid']}/stdin", json={"data": "x"})
    assert r.status_code == 400 and "without stdin" in r.json()["error"]


@pytest.mark.parametrize(("signal", "code"), [("SIGTERM", 143), ("KILL", 137), (2, 130)])
def test_signal(http: httpx.Client, sid: str, signal: Any, code: int) -> None:
    info = start(http, sid, ["sleep", "30"])
    r = http.post(f"/v1/sandboxes/{sid}/processes/{info['pid']}/signal", json={"signal": signal})
    assert r.status_code == 204, r.text
    assert wait_exit(http, sid, info["pid"])["exit_code"] == code


@pytest.mark.parametrize("signal", ["NOPE", "term; rm", 0, 65, True])
def test_a_bad_signal_is_a_400(http: httpx.Client, sid: str, signal: Any) -> None:
    info = start(http, sid, ["sleep", "30"])
    r = http.post(f"/v1/sandboxes/{sid}/processes/{info['pid']}/signal", json={"signal": signal})
    assert r.status_code == 400, r.text
    assert http.get(f"/v1/sandboxes/{sid}/processes/{info['pid']}").json()["running"]


# -- flow control -----------------------------------------------------------------------


def test_a_reader_that_stops_stops_the_pulling(
    server: Server, http: httpx.Client, sid: str
) -> None:
    """A client that does not read makes the daemon pull no more; others are not stalled;
    leaving ends the stream, and the process keeps running."""
    fake = vm_of(server, sid).processes
    flood = start(http, sid, ["flood"])
    url = f"/v1/sandboxes/{sid}/processes/{flood['pid']}/output"
    gone = threading.Event()

    def stall() -> None:
        with connect_sse(http, "GET", url) as source:
            next(source.iter_sse())
            gone.wait(10)  # reads nothing more

    reader = threading.Thread(target=stall)
    reader.start()
    try:
        time.sleep(1.0)
        before = len(fake.reads)
        time.sleep(1.0)
        assert len(fake.reads) == before  # blocked on the socket, not pulling
        other = start(http, sid, ["count", "3", "0.01"])
        assert text_of(events(http, sid, other["pid"])) == "1\n2\n3\n"
    finally:
        gone.set()
        reader.join(10)
    time.sleep(0.5)
    flood_reads = sum(1 for pid, _ in fake.reads if pid == flood["pid"])
    time.sleep(0.5)
    assert sum(1 for pid, _ in fake.reads if pid == flood["pid"]) == flood_reads
    assert http.get(f"/v1/sandboxes/{sid}/processes/{flood['pid']}").json()["running"]


def test_a_fast_writer_is_read_in_large_lingering_answers(
    server: Server, http: httpx.Client, sid: str
) -> None:
    fake = vm_of(server, sid).processes
    flood = start(http, sid, ["flood"])
    time.sleep(0.3)  # more than one answer's worth is written: the first comes back full
    url = f"/v1/sandboxes/{sid}/processes/{flood['pid']}/output"
    received = 0
    with connect_sse(http, "GET", url) as source:
        for event in source.iter_sse():
            received += len(json.loads(event.data).get("data", ""))
            if received >= 4 << 20:
                break
    assert fake.asks[0] == (256 << 10, 1, 0.0)
    assert (1 << 20, 1 << 20, 0.02) in fake.asks


def test_output_a_line_at_a_time_is_never_held_back(
    server: Server, http: httpx.Client, sid: str
) -> None:
    fake = vm_of(server, sid).processes
    info = start(http, sid, ["count", "5", "0.05"])
    assert text_of(events(http, sid, info["pid"])) == "1\n2\n3\n4\n5\n"
    assert fake.asks and all(linger == 0.0 for _, _, linger in fake.asks)


def test_exec_is_unchanged(http: httpx.Client, sid: str) -> None:
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["echo", "a"]})
    assert r.status_code == 200 and r.json()["stdout"] == "a\n"
