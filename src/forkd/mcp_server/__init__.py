"""``forkd mcp``: the daemon's sandboxes as tools of an MCP server (the official ``mcp``).

Agent frameworks reach tools through the Model Context Protocol. This server is a
client of a forkd daemon (through :class:`forkd.client.AsyncController`) that
offers: create a sandbox from a snapshot, fork several, run a command (as a
user), run Python in the warm interpreter, read and write files, branch, explore
(variants scored, the best kept), see what a sandbox changed, list
sandboxes and snapshots, kill; import a container image, list images, create a
snapshot (from a built or a container image, its service started); and the
lineage tree as the resource ``forkd://tree``.

It speaks stdio (the default: the agent starts it) or streamable HTTP
(``--http HOST:PORT``). Over HTTP it asks every request for the same bearer
token the daemon wants, when the daemon has one: the server acts with the
daemon's authority, so reaching it must need that authority too.

The tools are grouped by what they act on: :mod:`.sandbox_tools`,
:mod:`.image_tools`, and the original forkd server's under its names
(:mod:`.original_tools`); each reaches the daemon through :mod:`.daemon`.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer

from forkd.client import AsyncController
from forkd.mcp_server import daemon, image_tools, original_tools, sandbox_tools

INSTRUCTIONS = (
    "forkd runs code in isolated microVMs that fork copy-on-write from snapshots. "
    "create_sandbox gives you a running sandbox of a snapshot (list_snapshots shows them); "
    "exec and run_python run code in it; branch_sandbox saves its state as a new snapshot "
    "you can fork again, to try several things from one point; explore tries several next "
    "steps in copies at once, scores them and keeps the best. Kill sandboxes you are done with. "
    "create_snapshot makes a new template from a container image (import_image, list_images)."
)
TREE_URI = "forkd://tree"


def lineage_tree(snapshots: list[dict[str, Any]], sandboxes: list[dict[str, Any]]) -> list[Any]:
    """Snapshots nested under their parents, each with the sandboxes forked from it."""
    nodes = {
        s["tag"]: {
            "tag": s["tag"],
            "mode": s.get("mode", "full"),
            "status": s.get("status"),
            "branched_from": s.get("branched_from"),
            "pause_ms": s.get("pause_ms"),
            "sandboxes": [],
            "children": [],
        }
        for s in snapshots
    }
    for sb in sandboxes:
        node = nodes.get(sb.get("snapshot_tag"))
        if node is not None:
            node["sandboxes"].append({"id": sb["id"], "state": sb.get("state")})
    roots: list[dict[str, Any]] = []
    for s in snapshots:
        parent = nodes.get(s.get("parent_tag") or "")
        (parent["children"] if parent is not None else roots).append(nodes[s["tag"]])
    return roots


def build(connect: Callable[[], AsyncController]) -> MCPServer:
    """The MCP server; ``connect`` makes the daemon client each call uses."""
    server = MCPServer("forkd", instructions=INSTRUCTIONS)

    with_daemon = daemon.reaching(connect)
    sandbox_tools.fork_tools(server, with_daemon)
    sandbox_tools.command_tools(server, with_daemon)
    sandbox_tools.file_tools(server, with_daemon)
    sandbox_tools.lifecycle_tools(server, with_daemon)
    sandbox_tools.search_tools(server, with_daemon)
    image_tools.image_tools(server, with_daemon)
    image_tools.snapshot_tools(server, with_daemon)
    sandbox_tools.network_tools(server, with_daemon)
    original_tools.original_tools(server, with_daemon)
    original_tools.original_guest_tools(server, with_daemon)

    @server.resource(TREE_URI, name="lineage", mime_type="application/json")
    async def tree() -> str:
        """Snapshots nested under the snapshots they were branched from, each with the
        sandboxes running from it."""
        async with connect() as ctl:
            snaps, sandboxes = await ctl.list_snapshots(), await ctl.list_sandboxes()
        return json.dumps(lineage_tree(snaps, sandboxes))

    return server


def bearer_only(app: Any, token: str) -> Any:
    """``app`` (ASGI), answering 401 to HTTP requests without ``Bearer <token>``."""
    want = f"Bearer {token}".encode()

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, want):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"text/plain"),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": b"bearer token required\n"})
                return
        await app(scope, receive, send)

    return guarded
