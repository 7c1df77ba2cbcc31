"""``forkd mcp`` driven by the official ``mcp`` client library, against the real app
under uvicorn (fake VM driver): every tool listed and called, the lineage resource,
errors as tool errors; and the two transports of the real command, stdio and
streamable HTTP (which wants the daemon's token)."""

from __future__ import annotations

import asyncio
import json
import os
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
from mcp.types import CallToolResult, TextContent, TextResourceContents

from forkd import mcp_server
from forkd.client import AsyncController, Controller
from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from forkd.launcher import free_port
from tests.unit.conftest import TOKEN, Server, serving
from tests.unit.fake_images import FakeImporter
from tests.unit.fakes import FakeDriver, FakeVM

WEB = "127.0.0.1:5000/team/web:1"  # an image the fake importer knows
MISSING = "127.0.0.1:5000/team/web:404"  # and one it does not

TOOLS = {
    "create_sandbox",
    "fork_sandboxes",
    "exec",
    "run_python",
    "read_file",
    "write_file",
    "branch_sandbox",
    "explore",
    "diff_sandbox",
    "list_sandboxes",
    "list_snapshots",
    "kill_sandbox",
    "import_image",
    "list_images",
    "create_snapshot",
    "set_network",
    "egress_log",
    "list_secrets",
    # The original forkd MCP server's names (forkd-mcp), beside ours.
    "spawn_sandboxes",
    "get_sandbox",
    "exec_command",
    "eval_code",
    "ping_sandbox",
    "wait_for_text",
}


def _text(result: CallToolResult) -> str:
    """The text of a tool's first content (an error's message)."""
    content = result.content[0]
    assert isinstance(content, TextContent), content
    return content.text


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
    """List the tools and call each one but the images' (see
    :func:`exercise_the_image_tools`), and read the tree (also run on real VMs by
    tests/integration/test_mcp.py, on a daemon other tests share)."""
    tools = {t.name for t in (await client.list_tools()).tools}
    assert tools == TOOLS
    sid = _value(await client.call_tool("create_sandbox", {"snapshot_tag": template}))["id"]
    args: dict[str, Any] = {"snapshot_tag": template, "n": 2, "on_stop": "sync"}
    kids = _value(await client.call_tool("fork_sandboxes", args))
    assert len(kids) == 2
    ran = _value(await client.call_tool("exec", {"sandbox_id": sid, "command": "echo hi"}))
    assert ran["exit_code"] == 0
    args = {"sandbox_id": sid, "command": "id -un", "user": "nobody"}
    assert _value(await client.call_tool("exec", args))["stdout"] == "nobody\n"
    py = _value(await client.call_tool("run_python", {"sandbox_id": sid, "code": "x + 1"}))
    assert py["result"] == "42" and py["error"] is None
    args = {"sandbox_id": sid, "path": "/tmp/n", "content": "hello"}
    assert _value(await client.call_tool("write_file", args))["size"] == 5
    read = _value(await client.call_tool("read_file", {"sandbox_id": sid, "path": "/tmp/n"}))
    assert read["content"] == "hello" and read["truncated"] is False
    args = {"sandbox_id": sid, "tag": branch_tag}
    branch = _value(await client.call_tool("branch_sandbox", args))
    assert branch["tag"] == branch_tag and branch["branched_from"] == sid
    args = {
        "sandbox_id": sid,
        "variants": ["y = 2", "y = 5", "y = "],
        "score": "y * x",
        "python": True,
        "keep": 1,
    }
    explored = _value(await client.call_tool("explore", args))
    assert [r["score"] for r in explored["results"]][:2] == [205.0, 82.0]
    assert explored["results"][2]["error"] and explored["results"][0]["kept"]
    best = {"sandbox_id": explored["results"][0]["sandbox_id"]}
    args = {"sandbox_id": sid, "path": "/tmp"}
    changed = _value(await client.call_tool("diff_sandbox", args))
    assert {"path": "/tmp/n", "change": "added", "kind": "file", "size": 5, "mode": 0o644} in [
        {k: c[k] for k in ("path", "change", "kind", "size", "mode")} for c in changed["changes"]
    ]
    patch = _value(await client.call_tool("diff_sandbox", {**args, "patch": True}))["patch"]
    assert "+++ b/n" in patch and "+hello" in patch
    assert _value(await client.call_tool("kill_sandbox", best))["killed"]
    cut = _value(await client.call_tool("set_network", {"sandbox_id": sid, "deny_out": ["*"]}))
    assert cut["deny_out"] == ["*"]
    log = _value(await client.call_tool("egress_log", {"sandbox_id": sid}))
    assert log["records"] == [] or all(
        r["verdict"] in ("allowed", "refused") for r in log["records"]
    )
    assert isinstance(_value(await client.call_tool("list_secrets", {})), list)
    listed = {s["id"] for s in _value(await client.call_tool("list_sandboxes", {}))}
    assert {sid, *(k["id"] for k in kids)} <= listed
    snaps = {s["tag"] for s in _value(await client.call_tool("list_snapshots", {}))}
    assert {template, branch_tag} <= snaps

    tree_text = (await client.read_resource(mcp_server.TREE_URI)).contents[0]
    assert isinstance(tree_text, TextResourceContents), tree_text
    tree = json.loads(tree_text.text)
    (root,) = [node for node in tree if node["tag"] == template]
    assert branch_tag in [c["tag"] for c in root["children"]]
    assert {sid, *(k["id"] for k in kids)} <= {s["id"] for s in root["sandboxes"]}

    for one in (sid, *(k["id"] for k in kids)):
        assert _value(await client.call_tool("kill_sandbox", {"sandbox_id": one}))["killed"]
    gone = await client.call_tool("exec", {"sandbox_id": sid, "command": "true"})
    assert gone.is_error and "404" in _text(gone)  # the daemon's error, passed on
    bad = await client.call_tool("fork_sandboxes", {"snapshot_tag": template, "n": 0})
    assert bad.is_error


async def exercise_the_original_tools(client: Client, template: str, branch_tag: str) -> None:
    """The original forkd MCP server's tools, called with its argument names as its
    users' agents call them (also run on real VMs by tests/integration/test_mcp.py)."""
    args: dict[str, Any] = {
        "snapshot_tag": template,
        "n": 2,
        "per_child_netns": False,
        "prewarm": False,
    }
    kids = _value(await client.call_tool("spawn_sandboxes", args))
    assert len(kids) == 2
    sid = kids[0]["id"]
    assert _value(await client.call_tool("get_sandbox", {"sandbox_id": sid}))["id"] == sid
    args = {"sandbox_id": sid, "args": ["echo", "hi"], "timeout_secs": 30}
    ran = _value(await client.call_tool("exec_command", args))
    assert (ran["stdout"], ran["exit_code"]) == ("hi\n", 0)
    evaluated = _value(await client.call_tool("eval_code", {"sandbox_id": sid, "code": "x + 1"}))
    assert evaluated["result"] == "42" and evaluated["exit_code"] == 0
    assert _value(await client.call_tool("ping_sandbox", {"sandbox_id": sid}))["pong"] is True

    args = {"sandbox_id": sid, "path": "/tmp/app.log", "content": "starting\nserver ready\n"}
    assert _value(await client.call_tool("write_file", args))["size"] == 22
    args = {"sandbox_id": sid, "path": "/tmp/app.log", "marker": "ready", "timeout_secs": 10}
    waited = _value(await client.call_tool("wait_for_text", args))
    assert waited["found"] is True and "server ready" in waited["last_excerpt"], waited
    args = {
        "sandbox_id": sid,
        "path": "/tmp/app.log",
        "marker": "never",
        "timeout_secs": 0.5,
        "poll_interval_ms": 100,
    }
    waited = _value(await client.call_tool("wait_for_text", args))
    assert waited["found"] is False and waited["elapsed_ms"] >= 500, waited

    args = {"sandbox_id": sid, "tag": branch_tag, "diff": True}
    branch = _value(await client.call_tool("branch_sandbox", args))
    assert branch["mode"] == "diff" and branch["diff_physical_bytes"] >= 0, branch
    args = {"sandbox_id": sid, "tag": f"{branch_tag}-m", "measure_diff": True}
    measured = _value(await client.call_tool("branch_sandbox", args))
    assert measured["mode"] == "full" and "diff_logical_bytes" in measured, measured
    refused = await client.call_tool(
        "branch_sandbox", {"sandbox_id": sid, "diff": True, "wait": False}
    )
    assert refused.is_error and "400" in _text(refused)
    for kid in kids:
        assert _value(await client.call_tool("kill_sandbox", {"sandbox_id": kid["id"]}))["killed"]


async def exercise_the_image_tools(
    client: Client, ref: str, missing_ref: str, tag: str, ready_port: int, user: str
) -> None:
    """Import ``ref`` (its steps as progress), list it, make snapshot ``tag`` of the
    imported image with its service started and ready on ``ready_port``, and run a
    command in a sandbox of it: as the image's USER, ``user``, by default.
    ``missing_ref`` is a 404 (also run on real VMs by tests/integration/test_mcp.py)."""
    steps: list[str | None] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        steps.append(message)

    result = await client.call_tool("import_image", {"ref": ref}, progress_callback=progress)
    image = _value(result)
    assert image["kind"] == "container" and steps and all(steps)
    assert image["name"] in {i["name"] for i in _value(await client.call_tool("list_images", {}))}
    # By the name the import answered with (the CLI does so too), not the reference.
    args = {"tag": tag, "image": image["name"], "start": True, "ready_port": ready_port}
    snap = _value(await client.call_tool("create_snapshot", args))
    assert snap["tag"] == tag and snap["image"] == image["name"]
    sid = _value(await client.call_tool("create_sandbox", {"snapshot_tag": tag}))["id"]
    args = {"sandbox_id": sid, "command": "id -un"}
    assert _value(await client.call_tool("exec", args))["stdout"] == f"{user}\n"
    assert _value(await client.call_tool("kill_sandbox", {"sandbox_id": sid}))["killed"]
    missing = await client.call_tool("import_image", {"ref": missing_ref})
    assert missing.is_error and "404" in _text(missing)


def test_every_tool_and_the_tree(server: Server, template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(server.url, token=server.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_every_tool(client, template, "b1")

    asyncio.run(session())


def test_the_original_forkd_tools(server: Server, template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(server.url, token=server.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_the_original_tools(client, template, "ob")
            # create_snapshot takes the original's arguments too.
            args = {"tag": "made", "rw": False, "boot_wait_secs": 30}
            assert _value(await client.call_tool("create_snapshot", args))["tag"] == "made"

    asyncio.run(session())


def _serves_every_tool_over_stdio(params: StdioServerParameters, template: str) -> None:
    """The server ``params`` starts lists every tool and answers list_snapshots."""

    async def session() -> None:
        async with Client(params) as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS
            snaps = _value(await client.call_tool("list_snapshots", {}))
            assert [s["tag"] for s in snaps] == [template]

    asyncio.run(session())


def test_forkd_mcp_is_the_original_command_name(server: Server, template: str) -> None:
    """``forkd-mcp`` (the original's command, the console script) serves the same tools
    over stdio, reaching the daemon by FORKD_URL and FORKD_TOKEN as the original did."""
    script = Path(sys.executable).with_name("forkd-mcp")
    if not script.exists():
        pytest.skip(f"{script} is not installed: pip install -e . makes it")
    env = {"FORKD_URL": server.url, "FORKD_TOKEN": server.token}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    params = StdioServerParameters(command=str(script), args=[], env=env)

    _serves_every_tool_over_stdio(params, template)


class ListeningDriver(FakeDriver):
    """Guests with a TCP socket listening on 8080 (what the fake image serves on)."""

    async def boot(self, image: Any, **kw: Any) -> FakeVM:
        vm = await super().boot(image, **kw)
        vm.contents.files["/proc/net/tcp"] = (
            b"sl local rem st\n 0: 00000000:1F90 00000000:0000 0A\n"
        )
        return vm


def test_the_image_tools(settings: Settings, importer: FakeImporter, tmp_path: Path) -> None:
    port = free_port()
    app = create_app(settings, TOKEN, driver=ListeningDriver(), importer=importer)
    with serving(app, host="127.0.0.1", port=port):
        url = f"http://127.0.0.1:{port}"
        built = mcp_server.build(lambda: AsyncController(url, token=TOKEN))

        async def session() -> None:
            async with Client(built) as client:
                await exercise_the_image_tools(client, WEB, MISSING, "web", 8080, "app")
                args = {"tag": "web2", "image": WEB, "ready_port": 8080}  # without start
                refused = await client.call_tool("create_snapshot", args)
                assert refused.is_error and "400" in _text(refused)

        asyncio.run(session())
    assert importer.calls == [WEB, MISSING]


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
        # The stdio client passes on only a few variables: this checkout's forkd too.
        env={"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else None,
    )

    _serves_every_tool_over_stdio(params, template)


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
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "mcp",
            "--http",
            f"127.0.0.1:{port}",
            "--url",
            server.url,
            "--token-file",
            str(server.token_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
