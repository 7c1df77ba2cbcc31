"""The original forkd's command names, for the commands its users type: ``snapshot-info``,
``snapshot-diff``, ``snapshot-compact``, ``bench`` and ``quickstart``.

Each does what the original's did, through this daemon: ``snapshot-info`` is
``forkd snapshot info``; ``snapshot-compact --from T --to X`` makes the new full
snapshot X; ``snapshot-diff`` forks BASE, runs a command in the child, branches it
as a diff and removes the child; ``bench`` times a fork, an exec, a diff branch, a
fan-out from the branch and the cleanup; ``quickstart`` is the demo (a template,
forks, a branch, grandchildren, each step timed).
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from forkd.cli import render
from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown
from forkd.cli.snapshots import snapshot_info
from forkd.client import Controller, ControllerError
from forkd.states import SnapshotStatus

if TYPE_CHECKING:
    import httpx

ROW = "  {name:<22}{ms:>5} ms  {detail}"


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    daemon = functools.partial(with_connection, transport=transport)
    app.command("snapshot-info", help="The original forkd's name of 'forkd snapshot info'.")(
        daemon(snapshot_info)
    )
    app.command("snapshot-compact")(daemon(snapshot_compact_to))
    app.command("snapshot-diff")(daemon(snapshot_diff))
    app.command("bench")(daemon(bench))
    app.command("quickstart")(quickstart)


def snapshot_compact_to(
    conn: Connection,
    source: Annotated[str, typer.Option("--from", help="The snapshot to compact.")],
    to: Annotated[str, typer.Option("--to", help="The new full snapshot's tag.")],
) -> None:
    """Make a new full snapshot --to with --from's content (its diff chain flattened);
    --from is left as it is (the original forkd's snapshot-compact)."""
    if source == to:
        raise typer.BadParameter("--to must differ from --from")
    with daemon_errors(), conn.controller() as ctl, err.status(f"compacting {shown(source)}"):
        info = ctl.compact_snapshot(source, to=to)
    if conn.as_json:
        render.print_json(info)
        return
    out.print(f"compacted {shown(source)} into [bold magenta]{shown(to)}[/] (mode full)")
    out.print(render.kv_table({k: info.get(k) for k in ("tag", "dir", "parent_tag", "mode")}))


def snapshot_diff(
    conn: Connection,
    base: Annotated[str, typer.Option("--from", help="The snapshot to fork.")],
    tag: Annotated[str, typer.Option("--tag", help="The diff snapshot to make.")],
    command: Annotated[
        str,
        typer.Option("--exec", help="Run in the child first (split as a shell would, no shell)."),
    ],
    exec_timeout_secs: Annotated[
        float, typer.Option("--exec-timeout-secs", help="The command's time limit.")
    ] = 600,
) -> None:
    """Fork --from, run --exec in the child, branch it as a diff snapshot --tag (only the
    pages that differ from --from), remove the child (the original forkd's snapshot-diff)."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise typer.BadParameter(f"--exec: {exc}") from exc
    if not argv:
        raise typer.BadParameter("--exec is empty")
    with daemon_errors(), conn.controller() as ctl:
        (child,) = ctl.spawn_sandboxes(base, n=1)
        try:
            with err.status(f"running {shown(command)} in {child['id']}"):
                ran = ctl.exec_command(child["id"], argv, timeout_secs=exec_timeout_secs)
            if ran.get("exit_code") != 0:
                said = str(ran.get("stderr") or ran.get("stdout") or "")
                err.print(f"[red]{shown(command)} exited {ran.get('exit_code')}[/]\n{shown(said)}")
                raise typer.Exit(1)
            with err.status(f"branching {child['id']} as a diff"):
                info = ctl.branch_sandbox(child["id"], tag=tag, mode="diff")
        finally:
            _kill_quietly(ctl, child["id"])
    if conn.as_json:
        render.print_json(info)
        return
    keys = ("tag", "dir", "base_tag", "pause_ms", "diff_physical_bytes")
    out.print(render.kv_table({k: info.get(k) for k in keys}))


BenchTagOpt = Annotated[
    str | None, typer.Option("--tag", help="Snapshot to fork (default: the first listed).")
]
FanOutOpt = Annotated[int, typer.Option("--n", "-n", help="Fan-out children.", min=1, max=100)]
NetnsWordOpt = Annotated[
    str | None,
    typer.Option("--per-child-netns", metavar="true|false", help="The original's."),
]
Row = tuple[str, float, str]  # a bench step: its name, milliseconds, what it made


def bench(
    conn: Connection,
    tag: BenchTagOpt = None,
    n: FanOutOpt = 5,
    per_child_netns: NetnsWordOpt = None,
) -> None:
    """A latency probe against the daemon, as the original forkd's bench: a fork, an exec,
    a diff branch, a fan-out of -n from the branch, and the cleanup, each timed from here."""
    if per_child_netns is not None:
        from forkd.cli.original_commands import ignored

        ignored("--per-child-netns")
    with daemon_errors(), conn.controller() as ctl:
        if tag is None:
            tag = _first_ready_tag(ctl)
        rows = _timed_steps(ctl, tag, n)
    _show_bench(conn, tag, n, rows)


def _first_ready_tag(ctl: Controller) -> str:
    """The first ready snapshot the daemon lists; exit 1 when it has none."""
    listed = [s for s in ctl.list_snapshots() if s.get("status") == SnapshotStatus.READY]
    if not listed:
        err.print("no snapshots on the daemon: make one with 'forkd snapshot create'")
        raise typer.Exit(1)
    return str(listed[0]["tag"])


class _Stopwatch:
    """Runs the bench's steps, each timed into :attr:`rows`."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def timed(self, name: str, call: Callable[[], Any], detail: Callable[[Any], str]) -> Any:
        t0 = time.monotonic()
        result = call()
        self.rows.append((name, (time.monotonic() - t0) * 1000, detail(result)))
        return result


def _timed_steps(ctl: Controller, tag: str, n: int) -> list[Row]:
    """Fork ``tag``, exec in the child, branch it as a diff, fork -n from the branch, then
    clean up (also when a step failed): a row for each."""
    clock = _Stopwatch()
    made: list[str] = []
    branch: dict[str, Any] = {}
    try:
        (sb,) = clock.timed(
            "spawn (n=1)", lambda: ctl.spawn_sandboxes(tag, n=1), lambda r: str(r[0]["id"])
        )
        made.append(sb["id"])
        clock.timed(
            "exec round-trip",
            lambda: ctl.exec_command(sb["id"], ["echo", "bench"], 5),
            lambda r: f"exit={r.get('exit_code')}",
        )
        branch = clock.timed(
            "branch (diff)",
            lambda: ctl.branch_sandbox(sb["id"], mode="diff"),
            lambda r: (
                f"pause_ms={r.get('pause_ms')} "
                f"diff_physical_bytes={r.get('diff_physical_bytes', 0)}"
            ),
        )
        kids = clock.timed(
            f"fanout (n={n})", lambda: ctl.spawn_sandboxes(branch["tag"], n=n), lambda r: ""
        )
        made += [k["id"] for k in kids]
        name, ms, _ = clock.rows[-1]
        clock.rows[-1] = (name, ms, f"{ms / n:.0f}ms/child")
    finally:
        clock.rows.append(_clean_up(ctl, made, branch))
    return clock.rows


def _clean_up(ctl: Controller, made: list[str], branch: dict[str, Any]) -> Row:
    """Kill the sandboxes the bench made and delete its branch: the cleanup's row."""
    t0 = time.monotonic()
    for sid in made:
        _kill_quietly(ctl, sid)
    if branch:
        with _quiet():
            ctl.delete_snapshot(branch["tag"])
    return ("cleanup", (time.monotonic() - t0) * 1000, f"{len(made)} sandboxes, the branch")


def _show_bench(conn: Connection, tag: str, n: int, rows: list[Row]) -> None:
    if conn.as_json:
        steps = [{"step": name, "ms": round(ms), "detail": detail} for name, ms, detail in rows]
        render.print_json({"tag": tag, "n": n, "steps": steps})
        return
    out.print(f"forkd bench against snapshot [bold]{shown(tag)}[/]\n  fanout n={n}\n")
    for name, ms, detail in rows:
        out.print(shown(ROW.format(name=name, ms=round(ms), detail=detail)))
    out.print("  " + " " * 22 + "-----")
    out.print(f"  [bold]{'total':<22}{round(sum(r[1] for r in rows)):>5} ms[/]")


def quickstart(
    n: Annotated[int, typer.Option("-n", help="Children to fork.", min=1, max=64)] = 4,
    memory: Annotated[int, typer.Option("--memory", help="Guest memory, MiB.")] = 256,
    url: Annotated[
        str | None, typer.Option("--url", envvar="FORKD_URL", help="The daemon (started if none).")
    ] = None,
) -> None:
    """Build a template, fork -n children, branch one and fork grandchildren, each step
    timed: the demo (starts a daemon when none answers at --url)."""
    from forkd import demo

    demo.main(["--children", str(n), "--memory", str(memory), *(["--url", url] if url else [])])


def _kill_quietly(ctl: Controller, sandbox_id: str) -> None:
    with _quiet():
        ctl.kill_sandbox(sandbox_id)


def _quiet() -> contextlib.suppress:
    return contextlib.suppress(ControllerError)
