"""Issue 36: the original forkd's published clients, from PyPI, drive this daemon
unchanged: its SDK (``forkd==0.5.3``, in a venv of its own: the package name is ours
too) and its MCP server (``forkd-mcp``), each pointed at the daemon by its own
variables before anything runs. The daemon is the unit tests' (a real uvicorn, the real
app, fake VMs); the same clients' agent protocol runs on real VMs in
tests/integration/test_original_clients.py."""

from __future__ import annotations

import asyncio
import os

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests import original_published
from tests.unit.conftest import Server
from tests.unit.test_mcp_server import _value

SDK_SCRIPT = """
import json
from forkd import Controller, ControllerError
c = Controller()
out = {"snapshots": [s["tag"] for s in c.list_snapshots()]}
kids = c.spawn_sandboxes("py", n=2, per_child_netns=True, memory_limit_mib=256)
out["kids"] = [k["id"] for k in kids]
sid = kids[0]["id"]
out["exec"] = c.exec_command(sid, ["echo", "hi"])
out["eval"] = c.eval_code(sid, "1 / 0")
out["ok_eval"] = c.eval_code(sid, "6 * 7")
out["ping"] = c.ping_sandbox(sid)
out["branch"] = c.branch_sandbox(sid, tag="orig-b", diff=True)
out["grandkids"] = [g["id"] for g in c.spawn_sandboxes("orig-b", n=1)]
out["background"] = c.branch_sandbox(sid, tag="orig-w", mode="live", wait=False)
out["got"] = c.get_sandbox(sid)["id"]
try:
    c.delete_snapshot("no-such-tag")
except ControllerError as exc:
    out["missing"] = [exc.status, exc.body]
for sb in c.list_sandboxes():
    c.kill_sandbox(sb["id"])
out["left"] = c.list_sandboxes()
print(json.dumps(out))
"""


def test_the_original_sdk_from_pypi_drives_the_daemon(server: Server, py: str) -> None:
    out = original_published.run_script(SDK_SCRIPT, server.url, server.token)
    assert out["snapshots"] == ["py"]
    assert len(out["kids"]) == 2
    assert out["exec"]["exit_code"] == 0 and out["exec"]["stdout"] == "hi\n"
    # Its eval answer: {result, error, exit_code}, the error one line as it showed them.
    assert out["eval"]["error"] == "ZeroDivisionError: division by zero"
    assert out["eval"]["exit_code"] == 1
    assert out["ok_eval"]["result"] == "42" and out["ok_eval"]["error"] is None
    assert out["ping"]["pong"] is True, out["ping"]
    assert out["branch"]["tag"] == "orig-b" and out["branch"]["branched_from"] == out["kids"][0]
    assert out["branch"]["mode"] == "diff"
    assert len(out["grandkids"]) == 1
    assert out["background"]["status"] in ("writing", "ready")  # the original's word
    assert out["got"] == out["kids"][0]
    assert out["missing"][0] == 404 and "no-such-tag" in out["missing"][1]["error"]
    assert out["left"] == []


def test_the_original_mcp_server_from_pypi_drives_the_daemon(server: Server, py: str) -> None:
    script = original_published.venv() / "bin" / "forkd-mcp"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKD_", "PYTHON"))}
    env |= {"FORKD_URL": server.url, "FORKD_TOKEN": server.token}
    params = StdioServerParameters(command=str(script), args=[], env=env)

    async def session() -> None:
        async with Client(params) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {
                "list_snapshots",
                "spawn_sandboxes",
                "exec_command",
                "eval_code",
                "branch_sandbox",
                "kill_sandbox",
            } <= tools
            assert [s["tag"] for s in _value(await client.call_tool("list_snapshots", {}))] == [py]
            kids = _value(await client.call_tool("spawn_sandboxes", {"snapshot_tag": py}))
            sid = kids[0]["id"]
            args = {"sandbox_id": sid, "args": ["echo", "mcp"]}
            ran = _value(await client.call_tool("exec_command", args))
            assert ran["stdout"] == "mcp\n"
            ev = _value(await client.call_tool("eval_code", {"sandbox_id": sid, "code": "2 + 2"}))
            assert ev["result"] == "4"
            args = {"sandbox_id": sid, "tag": "mcp-b"}
            branch = _value(await client.call_tool("branch_sandbox", args))
            assert branch["tag"] == "mcp-b"
            await client.call_tool("kill_sandbox", {"sandbox_id": sid})
            assert _value(await client.call_tool("list_sandboxes", {})) == []

    asyncio.run(session())
