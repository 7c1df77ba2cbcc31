"""The host side of the agent channel against a real unix-socket server standing for the guest.

Each test scripts the guest: what it answers to each request line, and when.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.errors import AgentError
from forkd.vmm.agent_client import AgentClient

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
        w.write(_line({"id": req["id"], "ok": False, "error": "no such file: /x",
                       "kind": "FileNotFoundError"}))  # fmt: skip

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
