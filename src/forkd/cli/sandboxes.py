"""The commands on sandboxes: ``fork``, ``branch``, ``ps``, ``eval``, ``rm``, ``pause``,
``resume``, ``tree``."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.tree import Tree

from forkd.cli import render
from forkd.cli.evals import eval_
from forkd.cli.failures import act_on_each, daemon_errors
from forkd.cli.fork_progress import fork_progress
from forkd.cli.labels import FilterOpt, LabelOpt, parse_labels
from forkd.cli.network_options import AllowOutOpt, DenyOutOpt, network_of
from forkd.cli.options import Connection, with_connection
from forkd.cli.original_commands import HugeOpt, LiveForkOpt, NetnsOpt, ignore_flags
from forkd.cli.render import err, out, shown
from forkd.cli.snapshots import ModeOpt, TagOpt, WaitOpt, show_tree
from forkd.cli.stop_options import OnStopOpt, OnStopTimeoutOpt
from forkd.states import SnapshotStatus

if TYPE_CHECKING:
    import httpx


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the sandbox commands to ``app``; ``transport`` is for tests."""
    daemon = functools.partial(with_connection, transport=transport)
    app.command("rm")(daemon(rm))
    app.command("timeout")(daemon(set_timeout))
    app.command("update")(daemon(update))
    app.command("pause")(daemon(pause))
    app.command("resume")(daemon(resume))
    app.command("fork")(daemon(fork))
    app.command("branch")(daemon(branch))
    app.command("tree")(daemon(tree))
    app.command("ps")(daemon(ps))
    app.command("eval")(daemon(eval_))


def rm(
    conn: Connection,
    ids: Annotated[list[str], typer.Argument(help="Sandbox ids to kill.")],
    force: Annotated[
        bool, typer.Option("--force", help="Without running their stop hooks (--on-stop).")
    ] = False,
) -> None:
    """Kill sandboxes (each runs its stop hook first, unless --force)."""
    with daemon_errors(), conn.controller() as ctl:
        act_on_each(ids, lambda i: ctl.kill_sandbox(i, force=force), "killed", conn.as_json)


def set_timeout(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
    seconds: Annotated[str, typer.Argument(help="Seconds from now until its timeout, or 'none'.")],
    idle: Annotated[
        str | None,
        typer.Option("--idle", help="Its idle timeout: seconds with no use, or 'none'."),
    ] = None,
) -> None:
    """Extend or shorten a sandbox's timeout ('none' removes it), and its idle timeout."""
    from forkd.client.controller import KEEP

    timeout_s = _seconds_or_none(seconds)
    idle_s = KEEP if idle is None else _seconds_or_none(idle)
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.set_sandbox_timeout(sandbox_id, timeout_s, idle_timeout_s=idle_s)
    if conn.as_json:
        render.print_json(info)
        return
    when = info.get("expires_at") or "never"
    out.print(f"{shown(sandbox_id)}: {shown(str(info.get('on_timeout')))} at {shown(when)}")


def update(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")],
    evictable: EvictableOpt = None,
    auto_resume: AutoResumeOpt = None,
) -> None:
    """Change whether a sandbox may be hibernated under memory pressure (--no-evictable
    protects it) and whether a request wakes it when paused or hibernated."""
    if evictable is None and auto_resume is None:
        raise typer.BadParameter(
            "give --evictable/--no-evictable or --auto-resume/--no-auto-resume"
        )
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.update_sandbox(sandbox_id, evictable=evictable, auto_resume=auto_resume)
    if conn.as_json:
        render.print_json(info)
        return
    out.print(
        f"{shown(sandbox_id)}: evictable {str(info.get('evictable')).lower()}, "
        f"auto_resume {str(info.get('auto_resume')).lower()}"
    )


def _seconds_or_none(text: str) -> float | None:
    if text == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number or 'none'") from None


def pause(
    conn: Connection,
    ids: Annotated[list[str], typer.Argument(help="Sandbox ids to pause.")],
    hibernate: Annotated[
        bool,
        typer.Option(
            "--hibernate", help="Write each to disk and end its QEMU: its memory is freed."
        ),
    ] = False,
) -> None:
    """Pause sandboxes: their vCPUs stop, their memory stays (resume them with
    'forkd resume'; 'forkd branch' takes a paused one as it is). With --hibernate
    they go to disk and survive a daemon restart or a reboot."""
    verb, key = ("hibernated", "hibernated") if hibernate else ("paused", "paused")
    with daemon_errors(), conn.controller() as ctl:
        act_on_each(
            ids,
            lambda sid: ctl.pause_sandbox(sid, hibernate=hibernate),
            verb,
            conn.as_json,
            json_key=key,
        )


def resume(
    conn: Connection,
    ids: Annotated[list[str], typer.Argument(help="Sandbox ids to resume.")],
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="A new timeout, seconds from now.")
    ] = None,
) -> None:
    """Resume paused sandboxes (their clocks are set to the host's) or wake hibernated ones."""
    with daemon_errors(), conn.controller() as ctl:
        act_on_each(
            ids,
            lambda sid: ctl.resume_sandbox(sid, timeout_s=timeout),
            "resumed",
            conn.as_json,
            json_key="resumed",
        )


AutoResumeOpt = Annotated[
    bool | None,
    typer.Option(
        "--auto-resume/--no-auto-resume",
        help="Whether a request to a sandbox while paused or hibernated resumes it (default) "
        "or is refused (409).",
        show_default=False,
    ),
]

EvictableOpt = Annotated[
    bool | None,
    typer.Option(
        "--evictable/--no-evictable",
        help="Whether the daemon may hibernate these sandboxes when idle and the host runs "
        "short of memory (default), or never.",
        show_default=False,
    ),
]


# The original forkd's fork, which held its sandboxes and then removed them.
SettleOpt = Annotated[
    float | None,
    typer.Option(
        "--settle-secs",
        min=0,
        help="Hold the sandboxes this long (or until Ctrl-C or SIGTERM), then remove "
        "them, as the original forkd's fork did. With --agent-address (FORKD_TARGET), "
        "the first one answers the original agent protocol there: the original SDK's "
        "Sandbox().",
    ),
]
AgentAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--agent-address",
        envvar="FORKD_TARGET",
        help="With --settle-secs: serve the original agent protocol at HOST:PORT.",
    ),
]


ForkTagOpt = Annotated[str, typer.Option("--tag", help="Snapshot to fork from.")]
CountOpt = Annotated[int, typer.Option("-n", "--n", help="How many sandboxes.", min=1, max=1000)]
TimeoutSecsOpt = Annotated[
    float | None,
    typer.Option("--timeout-secs", help="Kill each sandbox after this many seconds."),
]
MemoryLimitOpt = Annotated[
    int | None,
    typer.Option("--memory-limit", "--memory-limit-mib", help="Memory limit per sandbox, MiB."),
]
InternetOpt = Annotated[
    bool | None, typer.Option("--internet/--no-internet", help="Network access.")
]
OnTimeoutOpt = Annotated[
    str | None,
    typer.Option(
        "--on-timeout", help="At --timeout-secs: kill (default), pause, hibernate or branch."
    ),
]
IdleTimeoutOpt = Annotated[
    float | None,
    typer.Option("--idle-timeout", help="Do --on-timeout after this many seconds with no use."),
]
SeedOpt = Annotated[
    int | None,
    typer.Option(
        "--seed", min=0, help="Child i gets seed+i: Python's random in it is seeded from it."
    ),
]


def fork(
    conn: Connection,
    tag: ForkTagOpt,
    n: CountOpt = 1,
    timeout_secs: TimeoutSecsOpt = None,
    memory_limit: MemoryLimitOpt = None,
    internet: InternetOpt = None,
    label: LabelOpt = None,
    on_timeout: OnTimeoutOpt = None,
    idle_timeout: IdleTimeoutOpt = None,
    seed: SeedOpt = None,
    auto_resume: AutoResumeOpt = None,
    evictable: EvictableOpt = None,
    on_stop: OnStopOpt = None,
    on_stop_timeout: OnStopTimeoutOpt = None,
    settle_secs: SettleOpt = None,
    agent_address: AgentAddressOpt = None,
    per_child_netns: NetnsOpt = False,
    hugepages: HugeOpt = False,
    live_fork: LiveForkOpt = False,
    allow_out: AllowOutOpt = None,
    deny_out: DenyOutOpt = None,
) -> None:
    """Fork N sandboxes from a snapshot (they inherit its labels; --label adds or overrides)."""
    ignore_flags(per_child_netns=per_child_netns, hugepages=hugepages, live_fork=live_fork)
    labels = parse_labels(label)
    if settle_secs is not None:
        held = {
            "memory_limit_mib": memory_limit,
            "timeout_secs": timeout_secs,
            "internet": internet,
            "metadata": labels,
            "seed": seed,
        }
        return _hold(conn, tag, n, settle_secs, agent_address, **held)
    t0 = time.monotonic()
    with daemon_errors(), conn.controller() as ctl, fork_progress(conn, tag, n, conn.as_json):
        sandboxes = ctl.spawn_sandboxes(
            tag,
            n=n,
            memory_limit_mib=memory_limit,
            timeout_secs=timeout_secs,
            internet=internet,
            metadata=labels,
            on_timeout=on_timeout,
            idle_timeout_s=idle_timeout,
            seed=seed,
            auto_resume=auto_resume,
            evictable=evictable,
            network=network_of(allow_out, deny_out),
            on_stop=on_stop,
            on_stop_timeout_s=on_stop_timeout,
        )
    if conn.as_json:
        render.print_json(sandboxes)
        return
    _show_forked(sandboxes, tag, time.monotonic() - t0)


def _hold(
    conn: Connection, tag: str, n: int, settle_secs: float, agent_address: str | None, **fork: Any
) -> None:
    """``fork --settle-secs``: the original forkd's fork, held then removed."""
    from forkd.cli.fork_hold import Hold

    Hold(conn, tag, n, settle_secs, agent_address).run(**fork)


def _show_forked(sandboxes: list[dict[str, Any]], tag: str, took: float) -> None:
    from forkd.cli.fork_hold import wall_clock_line

    out.print(render.sandbox_table(sandboxes))
    out.print(wall_clock_line(took), highlight=False)
    err.print(f"forked {len(sandboxes)} from {shown(tag)} in {took:.2f} s")


def branch(
    conn: Connection,
    from_sandbox: Annotated[
        str, typer.Option("--from-sandbox", help="Sandbox to branch (running, paused, hibernated).")
    ],
    n: Annotated[
        int, typer.Option("-n", help="Sandboxes to fork from the branch.", min=0, max=1000)
    ] = 1,
    tag: TagOpt = None,
    label: LabelOpt = None,
    mode: ModeOpt = None,
    wait: WaitOpt = True,
) -> None:
    """Branch a running sandbox, then fork N sandboxes from the branch (none with
    --no-wait: the branch is pending; 'forkd snapshot info TAG' shows when it is ready)."""
    labels = parse_labels(label)
    with daemon_errors(), conn.controller() as ctl:
        with err.status(f"branching {shown(from_sandbox)}"):
            info = ctl.branch_sandbox(from_sandbox, tag=tag, metadata=labels, mode=mode, wait=wait)
        kids: list[dict[str, Any]] = []
        if n > 0 and wait and info.get("status") == SnapshotStatus.READY:
            with err.status(f"forking {n} from {shown(str(info['tag']))}"):
                kids = ctl.spawn_sandboxes(info["tag"], n=n)
    if conn.as_json:
        render.print_json({"branch": info, "sandboxes": kids})
        return
    lineage = Tree(f"[green]{shown(from_sandbox)}[/] [dim](source)[/]")
    node = lineage.add(render.snapshot_label(info))
    for kid in kids:
        node.add(render.sandbox_label(kid))
    out.print(lineage)


def tree(conn: Connection) -> None:
    """Draw snapshots, branches and live sandboxes as a lineage tree."""
    with daemon_errors(), conn.controller() as ctl:
        show_tree(ctl, conn.as_json)


def ps(
    conn: Connection,
    filter_: FilterOpt = None,
    state: Annotated[
        str | None, typer.Option("--state", help="starting, running, paused, hibernated or dead.")
    ] = None,
    snapshot: Annotated[
        str | None, typer.Option("--snapshot", help="Only those forked from this snapshot.")
    ] = None,
) -> None:
    """List sandboxes."""
    labels = parse_labels(filter_, "--filter")
    with daemon_errors(), conn.controller() as ctl:
        sandboxes = ctl.list_sandboxes(state=state, snapshot=snapshot, metadata=labels)
    if conn.as_json:
        render.print_json(sandboxes)
        return
    out.print(render.sandbox_table(sandboxes))
    if not sandboxes:
        err.print("no sandboxes: run 'forkd fork --tag TAG'")
