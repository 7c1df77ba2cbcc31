"""The host side of the agent channel against a real unix-socket server standing for the guest.

Each test scripts the guest: what it answers to each request line, and when.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from forkd import limits
from forkd.agent_wire import ReadAnswer, RestoreAnswer
from forkd.errors import AgentError, SnapshotError, VMError
from forkd.token_bucket import TokenBucket
from forkd.vmm.agent import answers
from forkd.vmm.agent import client as agent_client
from forkd.vmm.agent import ops as agent_ops
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.agent.lines import MIN_PAUSE_SECS, LineSplitter
from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths
from forkd.vmm.vm import VM

# The guest's side of one connection: gets each request, may write anything back.
Guest = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def sock() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="forkd-ac-", dir="/tmp"))  # short: unix socket paths
    yield d / "agent.sock"
    shutil.rmtree(d, ignore_errors=True)


def _line(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg).encode() + b"\n"


def _ok(req: dict[str, Any], result: dict[str, Any]) -> bytes:
    return _line({"id": req["id"], "ok": True, "result": result})


async def _serve(sock: Path, guest: Guest, seen: list[bytes]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                seen.append(line)
                if line.strip():
                    await guest(json.loads(line), writer)
                    await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    return await asyncio.start_unix_server(handle, path=str(sock))


def _run(sock: Path, guest: Guest, body: Callable[[AgentClient], Awaitable[None]]) -> list[bytes]:
    """Start the guest, connect a client, run ``body``; returns the lines the guest got."""
    seen: list[bytes] = []

    async def main() -> None:
        server = await _serve(sock, guest, seen)
        client = AgentClient(sock)
        try:
            await client.connect(timeout=2)
            await body(client)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
    return seen


def test_answers_are_matched_by_id_not_by_order(sock: Path) -> None:
    held: list[dict[str, Any]] = []

    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        held.append(req)
        if len(held) == 2:  # answer the second request first
            for r in reversed(held):
                w.write(_ok(r, {"echo": r["n"]}))

    async def body(client: AgentClient) -> None:
        first, second = await asyncio.gather(
            client.call("echo", {"n": 1}, wait=2), client.call("echo", {"n": 2}, wait=2)
        )
        assert (first, second) == ({"echo": 1}, {"echo": 2})

    seen = _run(sock, guest, body)
    assert seen[0] == b"\n"  # a lone newline ends any partial line a snapshot left
    sent = [json.loads(line) for line in seen[1:]]
    assert {r["op"] for r in sent} == {"echo"} and sent[0]["id"] != sent[1]["id"]


def test_stale_and_broken_lines_are_dropped(sock: Path) -> None:
    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        w.write(_line({"id": req["id"] - 12345, "ok": True, "result": {"stale": True}}))
        w.write(b"not json at all\n")
        w.write(_line({"no": "id"}))
        w.write(_ok(req, {"fresh": True}))

    async def body(client: AgentClient) -> None:
        assert await client.call("ping", wait=2) == {"fresh": True}
        assert client.connected  # the junk did not break the connection

    _run(sock, guest, body)


def test_an_agent_restart_fails_requests_in_flight(sock: Path) -> None:
    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        if req["op"] == "eval":
            w.write(_line({"event": "started", "pid": 99}))  # the interpreter died
        else:
            w.write(_ok(req, {"pong": True}))

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match=r"agent restarted \(pid 99\)"):
            await client.call("eval", {"code": "crash()"}, wait=5)
        assert await client.call("ping", wait=2) == {"pong": True}  # the channel still works

    _run(sock, guest, body)


def test_a_guest_that_does_not_answer_times_out(sock: Path) -> None:
    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        return  # never answers

    async def body(client: AgentClient) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(AgentError, match=r"did not answer 'exec' within 0.2 s") as info:
            await client.call("exec", {"argv": ["true"]}, wait=0.2)
        assert loop.time() - started < 2
        assert info.value.kind is None

    _run(sock, guest, body)


def test_a_failure_answer_raises_with_the_guest_exception_kind(sock: Path) -> None:
    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        w.write(
            _line(
                {
                    "id": req["id"],
                    "ok": False,
                    "error": "no such file: /x",
                    "kind": "FileNotFoundError",
                }
            )
        )

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match="no such file: /x") as info:
            await client.call("file_read", {"path": "/x"}, wait=2)
        assert info.value.kind == "FileNotFoundError"

    _run(sock, guest, body)


def test_a_closed_connection_fails_pending_and_later_calls(sock: Path) -> None:
    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        w.close()  # the guest side goes away mid-request

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match="agent connection"):
            await client.call("ping", wait=5)
        with pytest.raises(AgentError, match="agent connection"):
            await client.call("ping", wait=5)
        assert not client.connected

    _run(sock, guest, body)


def test_connect_gives_up_on_a_socket_that_never_appears(sock: Path) -> None:
    async def main() -> None:
        with pytest.raises(AgentError, match="cannot connect to"):
            await AgentClient(sock).connect(timeout=0.1)

    asyncio.run(main())


# ------------------------------------------------------------------ hostile guests
#
# The guest below is a raw unix-socket server: it reads (or does not) and writes
# whatever bytes a hostile agent could.

Raw = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _run_raw(sock: Path, guest: Raw, body: Callable[[AgentClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await guest(reader, writer)
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.transport.abort()

        server = await asyncio.start_unix_server(handle, path=str(sock))
        client = AgentClient(sock)
        try:
            await client.connect(timeout=2)
            await asyncio.wait_for(body(client), 20)  # a hang fails the test
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


async def _next_request(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next request line (the lone newline a client sends first is skipped)."""
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("host went away")
        if line.strip():
            return dict(json.loads(line))


async def _answer_with(
    reader: asyncio.StreamReader, w: asyncio.StreamWriter, make: Callable[[dict[str, Any]], bytes]
) -> None:
    """Answer every request with ``make(request)``; a ping with a normal answer."""
    while True:
        req = await _next_request(reader)
        w.write(_ok(req, {"pong": True}) if req["op"] == "ping" else make(req))
        await w.drain()


async def _never_reads(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()  # SIGSTOPped agent: holds the port, reads nothing


BIG = {"path": "/big", "data": "A" * (8 << 20)}  # far more than the socket buffers hold


def test_a_guest_that_stops_reading_fails_the_call_and_aborts_the_channel(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "AGENT_WRITE_STALL_SECS", 0.3)

    async def body(client: AgentClient) -> None:
        loop = asyncio.get_running_loop()
        in_flight = asyncio.create_task(client.call("ping", wait=30))  # sent, never answered
        await asyncio.sleep(0.05)
        started = loop.time()
        with pytest.raises(AgentError, match="stopped reading: sending 'file_write'"):
            await client.call("file_write", BIG, wait=30)
        assert loop.time() - started < 2  # the stall timeout, not the 30 s wait
        with pytest.raises(AgentError, match="stopped reading"):
            await in_flight  # failed by the abort, not left to its own 30 s
        assert not client.connected
        with pytest.raises(AgentError, match="stopped reading"):
            await client.call("ping", wait=30)

    _run_raw(sock, _never_reads, body)


def test_close_does_not_wait_for_a_guest_that_stopped_reading(sock: Path) -> None:
    async def body(client: AgentClient) -> None:
        loop = asyncio.get_running_loop()
        writing = asyncio.create_task(client.call("file_write", BIG, wait=30))
        await asyncio.sleep(0.2)  # stuck: the guest takes nothing
        started = loop.time()
        await client.close()
        assert loop.time() - started < 0.5
        with pytest.raises(AgentError, match="agent connection closed"):
            await writing

    _run_raw(sock, _never_reads, body)


def test_a_slow_reader_is_not_taken_for_a_stopped_one(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "AGENT_WRITE_STALL_SECS", 0.4)

    async def slow_guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reader.readline()
        buf = b""
        while b"\n" not in buf:
            buf += await reader.read(64 << 10)
            await asyncio.sleep(0.04)  # 1.6 MiB/s: the request takes several stall periods
        req = json.loads(buf.split(b"\n")[0])
        w.write(_ok(req, {"size": len(req["data"])}))
        await w.drain()

    async def body(client: AgentClient) -> None:
        request = {"path": "/f", "data": "A" * (2 << 20)}
        assert await client.call("file_write", request, wait=30) == {"size": 2 << 20}

    _run_raw(sock, slow_guest, body)


def test_a_100_mib_line_is_dropped_as_it_streams_and_the_reader_survives(sock: Path) -> None:
    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _next_request(reader)
        piece = b"x" * (1 << 20)
        w.write(b'{"id":1,"ok":true,"result":"')  # an id nobody waits for
        for _ in range(100):
            w.write(piece)
            await w.drain()
        w.write(b'"}\n' + _ok(req, {"after": True}))
        await w.drain()
        await _answer_with(reader, w, lambda r: _ok(r, {}))

    async def body(client: AgentClient) -> None:
        tracemalloc.start()
        try:
            assert await client.call("exec", {"argv": ["x"]}, wait=30) == {"after": True}
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20  # the guest's 1 MiB pieces and read buffers, not the line
        assert client.dropped_lines == 1
        assert await client.call("ping", wait=2) == {"pong": True}

    _run_raw(sock, guest, body)


def test_an_answer_longer_than_its_op_allows_fails_at_once(sock: Path) -> None:
    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _next_request(reader)
        w.write(f'{{"id":{req["id"]},"ok":true,"result":{{"junk":"'.encode())
        for _ in range(10):  # 10 MiB for a file_write, whose answer is {"size": n}
            w.write(b"y" * (1 << 20))
            await w.drain()
        w.write(b'"}}\n')
        await _answer_with(reader, w, lambda r: _ok(r, {}))

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match=r"answer to 'file_write' is longer than 4194304"):
            await client.call("file_write", {"path": "/f", "data": ""}, wait=30)
        assert await client.call("ping", wait=2) == {"pong": True}

    _run_raw(sock, guest, body)


def test_the_largest_legitimate_answer_passes(sock: Path) -> None:
    data = "Q" * ((32 << 20) * 4 // 3)  # a 32 MiB file_read, as base64

    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _answer_with(reader, w, lambda r: _ok(r, {"data": data, "size": 32 << 20}))

    async def body(client: AgentClient) -> None:
        result = await client.call("file_read", {"path": "/f"}, wait=30)
        assert result["size"] == 32 << 20 and len(result["data"]) == len(data)

    _run_raw(sock, guest, body)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (b'{"id":%d,"ok":true,"result":{"s":"\xff\xfe\xc3"}}', r"not JSON \(UnicodeDecodeError\)"),
        (
            b'{"id":%d,"ok":true,"result":' + b"[" * 200_000 + b"]" * 200_000 + b"}",
            r"not JSON \(RecursionError\)",
        ),
        (b'{"id":%d,"ok":true,"result":{"a":1', r"not JSON \(JSONDecodeError\)"),
        (b'{"id":%d,"ok":"yes"}', "'ok' is not true or false"),
        (b'{"id":%d,"ok":true,"result":[1, 2]}', "'result' is not an object"),
        (b'{"id":%d,"ok":false,"error":{"no":"str"}}', "'error' or 'kind' is not a string"),
        (b'{"id":%d,"id":1,"ok":true,"result":{}}', "its id does not match"),
    ],
    ids=[
        "invalid-utf8",
        "nested-200k",
        "truncated",
        "ok-not-bool",
        "result-list",
        "error-object",
        "two-ids",
    ],
)
def test_a_hostile_answer_fails_only_its_request(sock: Path, answer: bytes, problem: str) -> None:
    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _answer_with(reader, w, lambda r: answer % r["id"] + b"\n")

    async def body(client: AgentClient) -> None:
        with pytest.raises(
            AgentError, match="malformed answer from the agent to 'exec': " + problem
        ):
            await client.call("exec", {"argv": ["x"]}, wait=5)
        assert client.connected
        assert await client.call("ping", wait=2) == {"pong": True}  # the reader lives on

    _run_raw(sock, guest, body)


def _raw_answer(req_id: int, raw: bytes) -> bytes:
    head = b'{"id":%d,"raw":%d,"ok":true,"result":{"chunks":[{"size":%d}]}}\n'
    return head % (req_id, len(raw), len(raw)) + raw


def test_raw_bytes_after_an_answer_are_its_own_however_they_are_cut() -> None:
    """Raw bytes may hold newlines and what looks like another answer: they are
    part of the line that announced them, kept or skipped with it."""
    forged = b'{"id":8,"ok":true,"result":{"forged":true}}\n'
    stream = (
        _raw_answer(7, b"a\nb" + forged)  # for 7, which waits
        + _raw_answer(9, forged * 2)  # for 9, which nobody waits for: skipped
        + b'{"id":8,"ok":true,"result":{"real":true}}\n'
    )
    waiting = {7: 1 << 20, 8: 1 << 20}
    for cut in (1, 2, 7, 64, len(stream)):
        splitter = LineSplitter(waiting.get)
        lines = [
            line for i in range(0, len(stream), cut) for line in splitter.feed(stream[i : i + cut])
        ]
        assert [(line.req_id, line.raw) for line in lines] == [
            (7, b"a\nb" + forged),
            (None, None),
            (8, None),
        ]
        assert json.loads(lines[2].data or b"")["result"] == {"real": True}


def test_raw_bytes_beyond_the_cap_fail_the_answer_and_are_skipped() -> None:
    splitter = LineSplitter({7: 100, 8: 100}.get)
    lines = list(splitter.feed(_raw_answer(7, b"x" * 200) + b'{"id":8,"ok":true}\n'))
    assert [(line.req_id, line.overlong, line.data) for line in lines] == [
        (7, True, None),
        (None, False, None),
        (8, False, b'{"id":8,"ok":true}'),
    ]


def test_raw_bytes_reach_the_caller_of_proc_read_only(sock: Path) -> None:
    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _answer_with(reader, w, lambda r: _raw_answer(r["id"], b"out\n"))

    async def body(client: AgentClient) -> None:
        result = await client.call("proc_read", {"pid": 1, "offset": 0}, wait=5)
        assert (result["chunks"], result["raw"]) == ([{"size": 4}], b"out\n")
        with pytest.raises(AgentError, match="raw bytes where none were asked for"):
            await client.call("exec", {"argv": ["x"]}, wait=5)
        assert await client.call("ping", wait=2) == {"pong": True}

    _run_raw(sock, guest, body)


def test_lines_with_unknown_ids_are_dropped_without_a_json_parse(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    real_loads = json.loads

    def loads(s: Any, **kw: Any) -> Any:
        if sys._getframe(1).f_globals["__name__"] == agent_client.__name__:
            parsed.append(len(s))
        return real_loads(s, **kw)

    monkeypatch.setattr(json, "loads", loads)
    junk = (
        b'{"id":7,"ok":true,"result":{}}\n'  # an id nobody waits for
        b'{"id": 8, "ok": true}\n'
        b"\xff\xfe not utf-8 at all\n"
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n"
        b'"a string"\n'
        b"\n"
    )

    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _next_request(reader)
        w.write(junk * 100 + _ok(req, {"fresh": True}))
        await w.drain()

    async def body(client: AgentClient) -> None:
        assert await client.call("ping", wait=5) == {"fresh": True}
        assert client.dropped_lines == 6 * 100
        assert len(parsed) == 1  # the answer alone

    _run_raw(sock, guest, body)


def test_a_flooding_guest_is_throttled_and_the_loop_stays_responsive(
    sock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "AGENT_READ_LINES_PER_SEC", 30_000)  # bursts of 3 000
    lines = 60_000  # ~0.2 s of work if taken in one go

    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req = await _next_request(reader)
        w.write(b"\n" * lines + _ok(req, {"last": True}))
        await w.drain()

    async def body(client: AgentClient) -> None:
        loop = asyncio.get_running_loop()
        lags: list[float] = []

        async def heartbeat() -> None:
            while True:
                before = loop.time()
                await asyncio.sleep(0.01)
                lags.append(loop.time() - before - 0.01)

        beat = asyncio.create_task(heartbeat())
        started = loop.time()
        assert await client.call("ping", wait=30) == {"last": True}
        took = loop.time() - started
        beat.cancel()
        assert took > 1.5  # 60 000 lines at 30 000 a second
        assert max(lags) < 0.1, f"the event loop stalled for {max(lags):.3f} s"

    _run_raw(sock, guest, body)


def test_token_bucket_pays_back_an_overdraft() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=100, burst=10, clock=lambda: now[0], min_pause=MIN_PAUSE_SECS)
    assert bucket.take(10) == 0
    assert bucket.take(1) == pytest.approx(0.05)  # 1 token short: at least MIN_PAUSE_SECS
    now[0] += 0.5  # refills 50, capped at the burst
    assert bucket.take(10) == 0
    assert bucket.take(20) == pytest.approx(0.2)


# ------------------------------------------------------------------ the VM's side of it


def _vm(run_dir: Path, proc: subprocess.Popen[bytes] | None = None) -> VM:
    machine = MachineConfig(
        4, 1, "tcg", run_dir / "vmlinuz", run_dir / "initrd", run_dir / "rootfs"
    )
    pid = proc.pid if proc is not None else 0
    return VM("child", RuntimePaths(run_dir), machine, run_dir / "ram", None, None, proc, pid)


def _restore_answer(**result: Any) -> Raw:
    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _answer_with(reader, w, lambda r: _ok(r, result))

    return guest


RNG_FAILED = "rng: OSError: [Errno 25] Inappropriate ioctl for device"


@pytest.mark.parametrize(
    ("result", "named"),
    [
        ({"rng_reseeded": False, "random_reseeded": True, "errors": [RNG_FAILED]}, "kernel RNG"),
        (
            {"rng_reseeded": True, "random_reseeded": False, "errors": ["random: boom"]},
            "Python random",
        ),
        ({"errors": []}, "kernel RNG and Python random"),  # an agent that does not say
    ],
    ids=["kernel-rng", "python-random", "not-reported"],
)
def test_a_fork_whose_rng_reseed_failed_is_refused(
    sock: Path, result: dict[str, Any], named: str
) -> None:
    snap = SimpleNamespace(dir=Path("/snaps/base"), memory=Path("/snaps/base/memory.bin"))

    async def body(client: AgentClient) -> None:
        vm = _vm(sock.parent)
        vm.agent = vm.guest.agent = client
        with pytest.raises(SnapshotError, match=f"could not reseed its {named}") as info:
            await vm.guest.reseed("child", 2, snap.dir, snap.memory, None)
        assert "/snaps/base" in str(info.value)
        for error in result["errors"]:
            assert error in str(info.value)

    _run_raw(sock, _restore_answer(clock_set=True, hostname_set=True, **result), body)


def test_a_fork_whose_hostname_failed_is_kept_with_a_warning(
    sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snap = SimpleNamespace(dir=Path("/snaps/base"), memory=Path("/snaps/base/memory.bin"))
    answer = _restore_answer(
        clock_set=True,
        rng_reseeded=True,
        random_reseeded=True,
        hostname_set=False,
        errors=["hostname: PermissionError: no"],
    )

    async def body(client: AgentClient) -> None:
        vm = _vm(sock.parent)
        vm.agent = vm.guest.agent = client
        await vm.guest.reseed("child", 2, snap.dir, snap.memory, None)

    with caplog.at_level(logging.WARNING, logger="forkd.vmm.vm"):
        _run_raw(sock, answer, body)
    assert "hostname: PermissionError: no" in caplog.text


def test_kill_takes_qemu_down_first_even_when_the_guest_stopped_reading(sock: Path) -> None:
    qemu = subprocess.Popen(["sleep", "300"])  # stands for QEMU; the test's server is the port
    dead_when_channels_closed: list[bool] = []

    async def body(client: AgentClient) -> None:
        vm = _vm(sock.parent, qemu)
        vm.agent = vm.guest.agent = client
        real_close = client.close

        async def close() -> None:
            dead_when_channels_closed.append(qemu.poll() is not None)
            await real_close()

        client.close = close  # type: ignore[method-assign]
        writing = asyncio.create_task(vm.guest.write_file("/big", b"A" * (8 << 20)))
        await asyncio.sleep(0.2)  # stuck: the guest takes nothing
        loop = asyncio.get_running_loop()
        started = loop.time()
        await vm.kill()
        assert loop.time() - started < 2
        with pytest.raises(AgentError):
            await writing

    try:
        _run_raw(sock, _never_reads, body)
    finally:
        qemu.kill()
        qemu.wait()
    assert dead_when_channels_closed[0] is True  # by kill; the harness closes it again
    assert not sock.parent.exists()  # the run directory is gone


def test_hold_waits_for_a_payload_to_be_answered_and_holds_requests_back(sock: Path) -> None:
    """A pause or snapshot holds the channel: not while an upload chunk is still being
    read by the guest (its answer has not come), and nothing is sent until release."""
    seen: list[str] = []
    answer_upload = asyncio.Event()

    async def guest(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            req = await _next_request(reader)
            seen.append(req["op"])
            if "payload" in req:
                await reader.readexactly(req["payload"])
                await answer_upload.wait()  # the guest is still busy with the chunk
            w.write(_ok(req, {"size": 3} if "payload" in req else {"pong": True}))
            await w.drain()

    async def body(client: AgentClient) -> None:
        upload = asyncio.ensure_future(
            client.call("file_upload_write", {"transfer_id": "t"}, payload=b"abc", wait=5)
        )
        await asyncio.sleep(0.1)
        holding = asyncio.ensure_future(client.hold(5))
        await asyncio.sleep(0.2)
        assert not holding.done()  # the chunk's answer has not come
        answer_upload.set()
        await upload
        await asyncio.wait_for(holding, 2)
        ping = asyncio.ensure_future(client.call("ping", wait=5))
        await asyncio.sleep(0.2)
        assert seen == ["file_upload_write"]  # held back
        client.release()
        assert (await ping) == {"pong": True} and seen[-1] == "ping"
        with pytest.raises(AgentError, match="still being read"):
            never = asyncio.ensure_future(
                client.call("file_upload_write", {"transfer_id": "t"}, payload=b"x", wait=5)
            )
            answer_upload.clear()
            await asyncio.sleep(0.1)
            await client.hold(0.2)
        client.release()  # nothing held after a failed hold: a no-op
        answer_upload.set()
        await never

    _run_raw(sock, guest, body)


def test_a_stats_answer_past_its_small_cap_fails_and_the_channel_goes_on(sock: Path) -> None:
    # stats is asked of every guest while someone watches: a guest must not make the
    # daemon parse megabytes for it.
    cap = agent_client.answer_cap("stats")
    assert cap == limits.AGENT_STATS_LINE_MAX_BYTES < agent_client.answer_cap("file_write")

    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        if req["op"] == "stats":
            w.write(_ok(req, {"processes": 1, "pad": "x" * cap}))
        else:
            w.write(_ok(req, {"pong": True}))

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError):
            await client.call("stats", {"paths": []}, wait=5)
        assert await client.call("ping", wait=2) == {"pong": True}

    _run(sock, guest, body)


def test_a_process_listing_past_its_cap_fails_and_the_channel_goes_on(sock: Path) -> None:
    # proc_list is asked by the idle check of every sandbox with a timeout: a guest
    # must not make the daemon's loop parse 16 MiB of JSON (half a second) each time.
    cap = agent_client.answer_cap("proc_list")
    assert cap == limits.AGENT_LISTING_LINE_MAX_BYTES < agent_client.answer_cap("exec")

    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        if req["op"] == "proc_list":
            w.write(_ok(req, {"processes": [{"pid": 1}] * (cap // 10)}))
        else:
            w.write(_ok(req, {"pong": True}))

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match="longer than"):
            await client.call("proc_list", wait=5)
        assert await client.call("ping", wait=2) == {"pong": True}

    _run(sock, guest, body)


@pytest.mark.parametrize("op", ["ping", "restore"])
def test_an_answer_to_ping_or_restore_past_its_small_cap_fails(sock: Path, op: str) -> None:
    # Asked at every boot, fork, resume and wake, unasked by any user: a guest must not
    # make the daemon parse megabytes for them.
    cap = agent_client.answer_cap(op)
    assert cap == limits.AGENT_SMALL_LINE_MAX_BYTES < agent_client.answer_cap("file_write")

    answered: list[str] = []

    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        big = not answered  # the first answer is the one past the cap
        answered.append(req["op"])
        w.write(_ok(req, {"pong": True, "errors": ["x"] * (cap // 4)} if big else {"pong": True}))

    async def body(client: AgentClient) -> None:
        with pytest.raises(AgentError, match="longer than"):
            await client.call(op, wait=5)
        assert await client.call("ping", wait=2) == {"pong": True}

    _run(sock, guest, body)


def test_a_guest_answering_each_ping_wrongly_at_once_is_asked_at_a_pace(sock: Path) -> None:
    """Waiting for a booting or resumed guest's agent: one that answers every ping with
    junk at once is pinged 20 times a second, not as fast as the loop can parse."""

    async def guest(req: dict[str, Any], w: asyncio.StreamWriter) -> None:
        w.write(_line({"id": req["id"], "ok": "yes", "result": {"pad": "x" * 60_000}}))

    qemu = subprocess.Popen(["sleep", "60"])  # stands for a running QEMU

    async def body(client: AgentClient) -> None:
        vm = _vm(sock.parent, qemu)
        vm.agent = vm.guest.agent = client
        with pytest.raises(VMError, match="did not answer within 1 s"):
            await vm.guest.wait_ready(1.0)

    try:
        seen = _run(sock, guest, body)
    finally:
        qemu.kill()
        qemu.wait()
    assert 5 <= len(seen) <= 1.0 / agent_ops.PING_RETRY_SECS + 5


def test_a_restores_list_of_failures_is_kept_short() -> None:
    result: RestoreAnswer = {
        "rng_reseeded": True,
        "random_reseeded": True,
        "errors": ["e" * 5000] * 50,
    }
    errors = agent_ops.check_reseeded(result, "child", Path("/snaps/base"))
    assert errors.count("e" * 300) == agent_ops.RESTORE_ERRORS_KEPT and len(errors) < 2600


@pytest.mark.parametrize(
    "answer",
    [{"eof": False, "raw": b"x" * 65}, {"eof": False, "data": "eHh4" * 22}],
    ids=["raw", "base64"],
)
def test_a_read_answered_with_more_than_was_asked_fails(answer: ReadAnswer) -> None:
    """A chunk of a transfer, a range of a file: the daemon holds what it asked for, and
    a guest's longer answer is refused, not passed on (or parsed as a manifest)."""
    assert answers.data_of({"eof": False, "raw": b"x" * 64}, 64) == b"x" * 64
    with pytest.raises(AgentError, match="for a read of at most 64"):
        answers.data_of(answer, 64)
