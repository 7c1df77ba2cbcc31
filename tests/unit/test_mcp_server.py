"""``forkd mcp`` driven by the official ``mcp`` client library, against the real app
under uvicorn (fake VM driver): every tool listed and called, the lineage resource,
errors as tool errors; and the two transports of the real command, stdio and
streamable HTTP (which wants the daemon's token)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from forkd import mcp_server
from forkd.client import AsyncController, Controller
from tests.unit.conftest import Server, free_port

TOOLS = {
    "create_sandbox", "fork_sandboxes", "exec", "run_python", "read_file", "write_file",
    "branch_sandbox", "list_sandboxes", "list_snapshots", "kill_sandbox",
}  # fmt: skip


def _value(result: Any) -> Any:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        value = result.structured_content
        return value.get("result", value) if isinstance(value, dict) and len(value) == 1 else value
    return json.loads(result.content[0].text)


@pytest.fixture
def template(server: Server) -> str:
    with Controller(server.url, token=server.token) as ctl:
        ctl.create_snapshot("py", memory_mib=128, warmup="x = 41")
    return "py"


async def exercise_every_tool(client: Client, template: str, branch_tag: str) -> None:
    """List the tools and call each one, and read the tree (also run on real VMs by
    tests/integration/test_mcp.py, on a daemon other tests share)."""
    tools = {t.name for t in (await client.list_tools()).tools}
    assert tools == TOOLS
    sid = _value(await client.call_tool("create_sandbox", {"snapshot_tag": template}))["id"]
    args: dict[str, Any] = {"snapshot_tag": template, "n": 2}
    kids = _value(await client.call_tool("fork_sandboxes", args))
    assert len(kids) == 2
    ran = _value(await client.call_tool("exec", {"sandbox_id": sid, "command": "echo hi"}))
    assert ran["exit_code"] == 0
    py = _value(await client.call_tool("run_python", {"sandbox_id": sid, "code": "x + 1"}))
    assert py["result"] == "42" and py["error"] is None
    args = {"sandbox_id": sid, "path": "/tmp/n", "content": "hello"}
    assert _value(await client.call_tool("write_file", args))["size"] == 5
    read = _value(await client.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/n"}))
    assert read["content"] == "hello" and read["truncated"] is False
    args = {"sandbox_id": sid, "tag": branch_tag}
    branch = _value(await client.call_tool("branch_sandbox", args))
    assert branch["tag"] == branch_tag and branch["branched_from"] == sid
    listed = {s["id"] for s in _value(await client.call_tool("list_sandboxes", {}))}
    assert {sid, *(k["id"] for k in kids)} <= listed
    snaps = {s["tag"] for s in _value(await client.call_tool("list_snapshots", {}))}
    assert {template, branch_tag} <= snaps

    tree = json.loads((await client.read_resource(mcp_server.TREE_URI)).contents[0].text)
    (root,) = [node for node in tree if node["tag"] == template]
    assert branch_tag in [c["tag"] for c in root["children"]]
    assert {sid, *(k["id"] for k in kids)} <= {s["id"] for s in root["sandboxes"]}

    for one in (sid, *(k["id"] for k in kids)):
        assert _value(await client.call_tool("kill_sandbox", {"sandbox_id": one}))["killed"]
    gone = await client.call_tool("exec", {"sandbox_id": sid, "command": "true"})
    assert gone.is_error and "404" in gone.content[0].text  # the daemon's error, passed on
    bad = await client.call_tool("fork_sandboxes", {"snapshot_tag": template, "n": 0})
    assert bad.is_error


def test_every_tool_and_the_tree(server: Server, template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(server.url, token=server.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_every_tool(client, template, "b1")

    asyncio.run(session())


def test_stdio_transport(server: Server, template: str) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "forkd.cli",
            "mcp",
            "--url",
            server.url,
            "--token-file",
            str(server.token_file),
        ],
    )

    async def session() -> None:
        async with Client(params) as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            snaps = _value(await client.call_tool("list_snapshots", {}))
            assert [s["tag"] for s in snaps] == [template]

    asyncio.run(session())


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "forkd mcp --http exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError("forkd mcp --http did not listen")


def test_http_transport_wants_the_token(server: Server, template: str, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "forkd.cli", "mcp", "--http", f"127.0.0.1:{port}",
         "--url", server.url, "--token-file", str(server.token_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(port, proc)
        url = f"http://127.0.0.1:{port}/mcp"
        assert httpx.post(url, json={}).status_code == 401
        wrong = httpx.post(url, json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401

        async def session() -> None:
            auth = {"Authorization": f"Bearer {server.token}"}
            async with (
                httpx2.AsyncClient(headers=auth) as http,
                Client(streamable_http_client(url, http_client=http)) as client,
            ):
                snaps = _value(await client.call_tool("list_snapshots", {}))
                assert [s["tag"] for s in snaps] == [template]

        asyncio.run(session())
    finally:
        proc.terminate()
        proc.wait(10)
