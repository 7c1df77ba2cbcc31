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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from forkd.client import AsyncController, ControllerError, EvalResult
from forkd.client.results import CommandResult

INSTRUCTIONS = (
    "forkd runs code in isolated microVMs that fork copy-on-write from snapshots. "
    "create_sandbox gives you a running sandbox of a snapshot (list_snapshots shows them); "
    "exec and run_python run code in it; branch_sandbox saves its state as a new snapshot "
    "you can fork again, to try several things from one point; explore tries several next "
    "steps in copies at once, scores them and keeps the best. Kill sandboxes you are done with. "
    "create_snapshot makes a new template from a container image (import_image, list_images)."
)
TREE_URI = "forkd://tree"
FILE_READ_LIMIT = 1 << 20  # what a tool answer carries: larger files are cut, and say so
WAIT_FOR_TEXT_TAIL = 4096  # wait_for_text reads a file's last 4 KiB, as the original did
MAX_WAIT_FOR_TEXT_SECS = 3600


async def _daemon(call: Awaitable[Any]) -> Any:
    """The daemon's answer, or its error as the tool's error (the agent reads it)."""
    try:
        return await call
    except ControllerError as exc:
        raise ToolError(str(exc)) from exc


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

    async def with_daemon(use: Callable[[AsyncController], Awaitable[Any]]) -> Any:
        async with connect() as ctl:
            return await _daemon(use(ctl))

    _command_tools(server, with_daemon)
    _file_tools(server, with_daemon)
    _lifecycle_tools(server, with_daemon)
    _search_tools(server, with_daemon)
    _image_tools(server, with_daemon)
    _snapshot_tools(server, with_daemon)
    _network_tools(server, with_daemon)
    _original_tools(server, with_daemon)
    _original_guest_tools(server, with_daemon)

    @server.resource(TREE_URI, name="lineage", mime_type="application/json")
    async def tree() -> str:
        """Snapshots nested under the snapshots they were branched from, each with the
        sandboxes running from it."""
        async with connect() as ctl:
            snaps, sandboxes = await ctl.list_snapshots(), await ctl.list_sandboxes()
        return json.dumps(lineage_tree(snaps, sandboxes))

    return server


# How a tool reaches the daemon: a client for the call, its errors as tool errors.
WithDaemon = Callable[[Callable[[AsyncController], Awaitable[Any]]], Awaitable[Any]]


def _command_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Sandboxes made, and used: commands, Python, files."""

    @server.tool()
    async def create_sandbox(
        snapshot_tag: str, timeout_s: float | None = None, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Start a sandbox from a snapshot (a fork: tens of milliseconds). ``timeout_s``:
        it is killed after that many seconds. Returns its SandboxInfo (its ``id``)."""
        infos = await with_daemon(
            lambda c: c.spawn_sandboxes(snapshot_tag, n=1, timeout_s=timeout_s, metadata=metadata)
        )
        return dict(infos[0])

    @server.tool()
    async def fork_sandboxes(
        snapshot_tag: str, n: int, timeout_s: float | None = None, seed: int | None = None
    ) -> list[dict[str, Any]]:
        """Start ``n`` sandboxes from one snapshot, all or none (1 to 100). ``seed``:
        sandbox i's Python ``random`` is seeded with seed+i, so a run can be replayed."""
        if not 1 <= n <= 100:
            raise ToolError("n must be between 1 and 100")
        infos = await with_daemon(
            lambda c: c.spawn_sandboxes(snapshot_tag, n=n, timeout_s=timeout_s, seed=seed)
        )
        return list(infos)

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


def _file_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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


def _search_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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


def _lifecycle_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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


def _network_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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


def _image_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Images, and the snapshots made from them."""

    @server.tool()
    async def import_image(ref: str, ctx: Context) -> dict[str, Any]:
        """Import a container image so snapshots can be made from it: a registry
        reference (``registry.example.com/team/app:1``), ``docker-daemon:IMAGE``,
        ``docker-archive:PATH``, ``oci-archive:PATH[:tag]`` or ``oci:DIR[:tag]`` (paths
        on the daemon's host). Reports each step as progress; returns the image's
        info (its ``name``, config, ``bytes_fetched`` and ``bytes_reused``)."""
        steps = 0

        async def report(message: str) -> None:
            nonlocal steps
            steps += 1
            await ctx.report_progress(steps, None, message)

        return dict(await with_daemon(lambda c: c.import_image_progress(ref, report)))

    @server.tool()
    async def list_images() -> list[dict[str, Any]]:
        """The images snapshots can be made from: built from recipes (``kind``
        recipe) and imported container images (``kind`` container, with their config
        and the references they were imported as)."""
        return list(await with_daemon(lambda c: c.list_images()))


def _snapshot_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """A template built (and, from a container image, imported first)."""

    @server.tool()
    async def create_snapshot(
        tag: str,
        image: str | None = None,
        start: bool = False,
        ready_port: int | None = None,
        ready_cmd: str | None = None,
        warmup: str | None = None,
        memory_mib: int | None = None,
        kernel: str | None = None,
        rootfs: str | None = None,
        rw: bool = False,
        tap: str | None = None,
        boot_wait_secs: float | None = None,
    ) -> dict[str, Any]:
        """Make a new snapshot ``tag`` to create sandboxes from. ``image``: a built
        image's name (list_images; default python) or a container image reference,
        imported first. ``start``: run the image's Entrypoint+Cmd before the snapshot
        and wait until guest TCP ``ready_port`` listens or the shell line ``ready_cmd``
        exits 0, so every sandbox starts with that service already running.
        ``warmup``: Python run in the warm interpreter first. Takes seconds to minutes.
        The original forkd's ``kernel`` and ``rootfs`` (files of a built image on the
        daemon's host), ``rw``, ``tap`` and ``boot_wait_secs`` are taken too."""
        extra: dict[str, Any] = {
            k: v for k, v in (("kernel", kernel), ("rootfs", rootfs), ("tap", tap)) if v
        }
        if rw:
            extra["rw"] = True
        answer = await with_daemon(
            lambda c: c.create_snapshot(
                tag,
                image=image,
                warmup=warmup,
                memory_mib=memory_mib,
                start=start or None,
                ready_port=ready_port,
                ready_cmd=ready_cmd,
                boot_wait_secs=boot_wait_secs,
                **extra,
            )
        )
        return dict(answer)


def _original_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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


def _original_guest_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
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
