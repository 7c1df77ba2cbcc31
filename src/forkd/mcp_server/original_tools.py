"""The original forkd MCP server's tools, by its names and arguments, beside forkd's own:
a client configured for ``forkd-mcp`` keeps working."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from forkd.mcp_server.daemon import WithDaemon

WAIT_FOR_TEXT_TAIL = 4096  # wait_for_text reads a file's last 4 KiB, as the original did
MAX_WAIT_FOR_TEXT_SECS = 3600


def original_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """The original forkd MCP server's tools, by its names and arguments, beside ours: a
    client configured for ``forkd-mcp`` keeps working (list_sandboxes, list_snapshots,
    kill_sandbox, branch_sandbox and create_snapshot are shared by both sets)."""

    @server.tool()
    async def spawn_sandboxes(
        snapshot_tag: str,
        n: int = 1,
        per_child_netns: bool = False,
        memory_limit_mib: int | None = None,
        prewarm: bool = False,
        live_fork: bool = False,
    ) -> list[dict[str, Any]]:
        """Fork ``n`` sandboxes from a snapshot, all or none (the original forkd's name
        for fork_sandboxes). ``memory_limit_mib``: a host memory cap per sandbox (default:
        its guest RAM and QEMU's overhead). Returns their SandboxInfo."""
        return list(
            await with_daemon(
                lambda c: c.spawn_sandboxes(
                    snapshot_tag,
                    n=n,
                    memory_limit_mib=memory_limit_mib,
                    per_child_netns=per_child_netns or None,
                    prewarm=prewarm or None,
                    live_fork=live_fork or None,
                )
            )
        )

    @server.tool()
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        """One sandbox's SandboxInfo."""
        return dict(await with_daemon(lambda c: c.get_sandbox(sandbox_id)))


def original_guest_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """The original forkd MCP server's tools that talk to a sandbox's guest."""

    @server.tool()
    async def exec_command(
        sandbox_id: str, args: list[str], timeout_secs: float = 30
    ) -> dict[str, Any]:
        """Run a program (``args``, no shell) in the sandbox and wait for it: the
        answer of POST /v1/sandboxes/{id}/exec (stdout, stderr, exit_code)."""
        return dict(await with_daemon(lambda c: c.exec_command(sandbox_id, args, timeout_secs)))

    @server.tool()
    async def eval_code(sandbox_id: str, code: str) -> dict[str, Any]:
        """Evaluate Python in the sandbox's warm interpreter: the answer of
        POST /v1/sandboxes/{id}/eval (result, error, exit_code, ...)."""
        return dict(await with_daemon(lambda c: c.eval_code(sandbox_id, code)))

    @server.tool()
    async def ping_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Ask the sandbox's guest agent whether it answers."""
        return dict(await with_daemon(lambda c: c.ping_sandbox(sandbox_id)))

    @server.tool()
    async def wait_for_text(
        sandbox_id: str,
        path: str,
        marker: str,
        timeout_secs: float = 60,
        poll_interval_ms: int = 200,
    ) -> dict[str, Any]:
        """Wait until the file ``path`` in the sandbox ends with text containing
        ``marker`` (its last 4 KiB are read every ``poll_interval_ms``), at most
        ``timeout_secs``: ``{"found", "elapsed_ms", "last_excerpt"}``."""
        if not 0 < timeout_secs <= MAX_WAIT_FOR_TEXT_SECS:
            raise ToolError(f"timeout_secs must be > 0 and at most {MAX_WAIT_FOR_TEXT_SECS}")
        interval = min(max(poll_interval_ms, 10), 10_000) / 1000
        return await _wait_for_text(with_daemon, sandbox_id, path, marker, timeout_secs, interval)


async def _wait_for_text(
    with_daemon: WithDaemon,
    sandbox_id: str,
    path: str,
    marker: str,
    timeout_secs: float,
    interval: float,
) -> dict[str, Any]:
    started = time.monotonic()
    argv = ["tail", "-c", str(WAIT_FOR_TEXT_TAIL), "--", path]
    excerpt = ""
    while True:
        raw = await with_daemon(lambda c: c.exec_command(sandbox_id, argv, 5))
        if raw.get("exit_code") == 0:
            excerpt = str(raw.get("stdout") or "")
        elapsed = time.monotonic() - started
        if marker in excerpt or elapsed >= timeout_secs:
            found = marker in excerpt
            return {
                "found": found,
                "elapsed_ms": round(elapsed * 1000),
                "last_excerpt": excerpt[-256:],
            }
        await asyncio.sleep(min(interval, timeout_secs - elapsed))
