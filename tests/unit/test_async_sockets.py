"""The async SDK's WebSocket and streamed-file parts over the fake driver under a real
uvicorn: a terminal (type, resize, exit code), a guest port's WebSocket, a TCP tunnel,
and files streamed both ways (a file and a directory)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import wsproto.events

from forkd.client import AsyncController, AsyncSandbox, ControllerError
from tests.integration import guest_web
from tests.unit import port_fixtures
from tests.unit.conftest import Server

GUEST_PORT = port_fixtures.GUEST_PORT
ECHO_PORT = 7000
web, http, sid, _vm = port_fixtures.web, port_fixtures.http, port_fixtures.sid, port_fixtures.vm


def test_terminal_websocket_and_tunnel(server: Server, sid: str) -> None:
    echo = guest_web.serve_tcp_echo("127.0.0.1", 0)
    _vm(server, sid).ports[ECHO_PORT] = echo.getsockname()[1]

    async def sockets() -> None:
        async with AsyncController(server.url, token=server.token, timeout=10) as ctl:
            sb = await AsyncSandbox.connect(sid, controller=ctl)
            async with await sb.pty.create(cols=100, rows=30, cmd=["cat"]) as term:
                proc = _vm(server, sid).processes.procs[term.pid]
                assert proc.pty and proc.size == (100, 30)
                await term.send_stdin("abc")
                got = b""
                while b"abc" not in got:
                    got += await term.read(5) or b""
                await term.resize(120, 40)
                deadline = time.monotonic() + 5
                while proc.size != (120, 40):
                    assert time.monotonic() < deadline, proc.size
                    await asyncio.sleep(0.02)
                assert await term.kill()
                assert await term.wait() == 137 and term.exited
            with pytest.raises(ValueError):
                await term.resize(0, 10)

            async with sb.websocket(GUEST_PORT, "/ws", subprotocols=["chat"]) as ws:
                assert ws.subprotocol == "chat"
                await ws.send_text("hello")
                event = await ws.receive(timeout=5)
                assert isinstance(event, wsproto.events.TextMessage) and event.data == "hello"

            async with ctl.open_tunnel(sid, ECHO_PORT) as tunnel:
                await tunnel.send_bytes(b"raw\x00bytes")
                got = b""
                while len(got) < 9:
                    event = await tunnel.receive(timeout=5)
                    assert isinstance(event, wsproto.events.BytesMessage), event
                    got += bytes(event.data)
                assert got == b"raw\x00bytes"
            with pytest.raises(ControllerError) as refused:
                async with ctl.open_tunnel(sid, 0):
                    pass
            assert refused.value.status == 400

    try:
        asyncio.run(sockets())
    finally:
        echo.close()


def test_files_streamed_both_ways(server: Server, sid: str, tmp_path: Path) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for piece in (b"a" * 100_000, b"b" * 50_000):
            yield piece

    async def files() -> None:
        async with AsyncController(server.url, token=server.token, timeout=10) as ctl:
            sb = await AsyncSandbox.connect(sid, controller=ctl)
            assert (await sb.files.write("/tmp/big", chunks()))["size"] == 150_000
            streamed = [c async for c in sb.files.stream("/tmp/big")]
            assert b"".join(streamed) == b"a" * 100_000 + b"b" * 50_000
            local = tmp_path / "up.txt"
            local.write_text("uploaded")
            await sb.files.upload(local, "/tmp/up.txt")
            assert await sb.files.read_text("/tmp/up.txt") == "uploaded"
            assert await sb.files.download("/tmp/big", tmp_path / "down") == 150_000
            assert (tmp_path / "down").stat().st_size == 150_000
            tree = tmp_path / "tree"
            (tree / "sub").mkdir(parents=True)
            (tree / "sub" / "f.txt").write_text("in a directory")
            await sb.files.upload(tree, "/tmp/tree")
            await sb.files.download("/tmp/tree", tmp_path / "back", directory=True)
            assert (tmp_path / "back" / "tree" / "sub" / "f.txt").read_text() == "in a directory"
            # A bytearray is sent as its bytes, not iterated as integers.
            await ctl.upload_file(sid, "/tmp/ba", bytearray(b"abc"))
            assert await sb.files.read("/tmp/ba") == b"abc"
            with pytest.raises(ControllerError) as missing:
                await sb.files.read("/tmp/none")
            assert missing.value.status == 404

    asyncio.run(files())
