"""forkd's MCP tools on sandboxes: made and used (commands, Python, files), explored
and diffed, branched, listed and killed, and what they may reach on the network."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from forkd.client import AsyncController, EvalResult
from forkd.client.results import CommandResult
from forkd.mcp_server.daemon import WithDaemon

FILE_READ_LIMIT = 1 << 20  # what a tool answer carries: larger files are cut, and say so


def fork_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Sandboxes made: one, or many from one snapshot."""

    @server.tool()
    async def create_sandbox(
        snapshot_tag: str,
        timeout_s: float | None = None,
        metadata: dict[str, str] | None = None,
        on_stop: str | None = None,
    ) -> dict[str, Any]:
        """Start a sandbox from a snapshot (a fork: tens of milliseconds). ``timeout_s``:
        it is killed after that many seconds. ``on_stop``: a shell command it runs before
        it is stopped (killed, timed out, hibernated), e.g. to flush or save its work.
        Returns its SandboxInfo (its ``id``)."""
        infos = await with_daemon(
            lambda c: c.spawn_sandboxes(
                snapshot_tag, n=1, timeout_s=timeout_s, metadata=metadata, on_stop=on_stop
            )
        )
        return dict(infos[0])

    @server.tool()
    async def fork_sandboxes(
        snapshot_tag: str,
        n: int,
        timeout_s: float | None = None,
        seed: int | None = None,
        on_stop: str | None = None,
    ) -> list[dict[str, Any]]:
        """Start ``n`` sandboxes from one snapshot, all or none (1 to 100). ``seed``:
        sandbox i's Python ``random`` is seeded with seed+i, so a run can be replayed.
        ``on_stop``: a shell command each runs before it is stopped."""
        if not 1 <= n <= 100:
            raise ToolError("n must be between 1 and 100")
        infos = await with_daemon(
            lambda c: c.spawn_sandboxes(
                snapshot_tag, n=n, timeout_s=timeout_s, seed=seed, on_stop=on_stop
            )
        )
        return list(infos)


def command_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Sandboxes used: commands, Python, files."""

    @server.tool()
    async def exec(
        sandbox_id: str, command: str, timeout_s: float = 60, user: str | None = None
    ) -> dict[str, Any]:
        """Run a shell command (``/bin/sh -c``) in the sandbox and wait for it:
        stdout, stderr, exit_code (124: it ran past ``timeout_s`` and was killed).
        ``user``: run as this user (name, uid, name:group or uid:gid); default the
        image's USER, else root."""
        argv = ["/bin/sh", "-c", command]
        raw = await with_daemon(
            lambda c: c.exec_command(sandbox_id, argv, timeout_secs=timeout_s, user=user)
        )
        result = CommandResult.from_answer(raw)
        return {"stdout": result.stdout, "stderr": result.stderr, "exit_code": result.exit_code}

    @server.tool()
    async def run_python(sandbox_id: str, code: str, timeout_s: float = 60) -> dict[str, Any]:
        """Run Python in the sandbox's warm interpreter; names persist between calls.
        Returns the last expression's repr (``result``), printed output and any error."""
        raw = await with_daemon(lambda c: c.eval_code(sandbox_id, code, timeout_s))
        result = EvalResult.from_answer(raw)
        return {
            "result": result.result,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "error": result.error,
        }


def file_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Whole files in and out of a sandbox."""

    @server.tool()
    async def read_file(sandbox_id: str, path: str) -> dict[str, Any]:
        """Read a file of the sandbox as text (undecodable bytes replaced; the first MiB)."""
        data = await with_daemon(lambda c: c.read_file(sandbox_id, path))
        return {
            "path": path,
            "size": len(data),
            "truncated": len(data) > FILE_READ_LIMIT,
            "content": data[:FILE_READ_LIMIT].decode("utf-8", "replace"),
        }

    @server.tool()
    async def write_file(sandbox_id: str, path: str, content: str) -> dict[str, Any]:
        """Write text to a file of the sandbox (created, or replaced)."""
        await with_daemon(lambda c: c.write_file(sandbox_id, path, content))
        return {"path": path, "size": len(content.encode())}


def search_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Explore (variants scored, the best kept) and diff (what a sandbox changed)."""

    @server.tool()
    async def explore(
        sandbox_id: str,
        variants: list[str],
        score: str | None = None,
        keep: int = 1,
        minimize: bool = False,
        python: bool = False,
        timeout_s: float = 300,
        seed: int | None = None,
    ) -> dict[str, Any]:
        """Try several next steps from the sandbox's current state at once: each of
        ``variants`` (shell commands; Python code with ``python=True``) runs in its own
        copy, then ``score`` (a shell command printing a number on its last line; with
        ``python=True``, Python whose value is the number) rates it. The best ``keep``
        copies keep running (their ids in the results, best first; higher scores are
        better unless ``minimize``); the rest are killed. The sandbox itself is left as
        it was. A variant that fails has score null and its error."""

        def step(text: str) -> dict[str, Any]:
            return {"eval": text} if python else {"exec": ["/bin/sh", "-c", text]}

        res = await with_daemon(
            lambda c: c.explore_sandbox(
                sandbox_id,
                [step(v) for v in variants],
                None if score is None else step(score),
                keep=keep,
                minimize=minimize,
                timeout_secs=timeout_s,
                seed=seed,
            )
        )
        return dict(res.raw)

    @server.tool()
    async def diff_sandbox(
        sandbox_id: str, path: str = "/", against: str | None = None, patch: bool = False
    ) -> dict[str, Any]:
        """What the sandbox changed under ``path`` since the snapshot it was forked from
        (or ``against``: a snapshot tag or another sandbox's id): the added, modified
        and removed paths, or with ``patch=True`` a unified diff of the text files."""
        if patch:
            text = await with_daemon(lambda c: c.diff_patch(sandbox_id, path, against))
            return {"patch": text}
        res = await with_daemon(lambda c: c.diff_sandbox(sandbox_id, path, against))
        return dict(res.raw)


def lifecycle_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Branch, list, kill."""

    @server.tool()
    async def branch_sandbox(
        sandbox_id: str,
        tag: str | None = None,
        mode: str | None = None,
        diff: bool = False,
        measure_diff: bool = False,
        wait: bool = True,
    ) -> dict[str, Any]:
        """Save the running sandbox's whole state as a new snapshot (it pauses for
        milliseconds, then goes on). Fork the snapshot to get copies of that moment.
        ``mode``: full (default), diff or live (``diff=True`` is mode diff);
        ``measure_diff``: a full branch that reports what a diff would store;
        ``wait=False``: answer at once (status writing) and write in the background."""
        return dict(
            await with_daemon(
                lambda c: c.branch_sandbox(
                    sandbox_id, tag=tag, mode=mode, wait=wait, diff=diff, measure_diff=measure_diff
                )
            )
        )

    @server.tool()
    async def list_sandboxes(state: str | None = None) -> list[dict[str, Any]]:
        """The sandboxes (``state``: running, paused, hibernated or dead)."""
        return list(await with_daemon(lambda c: c.list_sandboxes(state=state)))

    @server.tool()
    async def list_snapshots() -> list[dict[str, Any]]:
        """The snapshots sandboxes can be created from: templates and branches."""
        return list(await with_daemon(lambda c: c.list_snapshots()))

    @server.tool()
    async def kill_sandbox(sandbox_id: str) -> dict[str, Any]:
        """Kill the sandbox and free what it held."""
        await with_daemon(lambda c: c.kill_sandbox(sandbox_id))
        return {"id": sandbox_id, "killed": True}


def network_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """What sandboxes may reach, what they reached, and the secrets they can use."""

    @server.tool()
    async def set_network(
        sandbox_id: str, allow_out: list[str] | None = None, deny_out: list[str] | None = None
    ) -> dict[str, Any]:
        """Replace what a sandbox may reach: allow_out (only these: host names,
        '*.domain', addresses, CIDRs; none: every public host) and deny_out (never these;
        ['*']: nothing). New connections follow it at once; open ones it denies close."""

        async def change(ctl: AsyncController) -> Any:
            rules = (await ctl.sandbox_network(sandbox_id))["rules"] or None
            return await ctl.update_sandbox_network(
                sandbox_id, allow_out or [], deny_out or [], rules
            )

        return dict(await with_daemon(change))

    @server.tool()
    async def egress_log(sandbox_id: str, after: int = 0) -> dict[str, Any]:
        """What a sandbox reached and was refused (host, port, method and path, which
        secrets were put in), oldest first; give next_after as after for more."""
        return dict(await with_daemon(lambda c: c.sandbox_egress(sandbox_id, after=after)))

    @server.tool()
    async def list_secrets() -> list[dict[str, Any]]:
        """The secrets a sandbox can use without holding them: write ${secrets.NAME} where
        the credential goes (a header, an environment variable) and the daemon puts the
        value in on requests to the secret's hosts. Names and hosts only, never values."""
        return list(await with_daemon(lambda c: c.list_secrets()))
