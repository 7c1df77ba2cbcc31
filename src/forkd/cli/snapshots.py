"""``forkd snapshot`` (create, ls, info, compact, rm, ``--from-sandbox`` to branch) and
``forkd rmi``."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli import render
from forkd.cli.failures import act_on_each, daemon_errors, fail
from forkd.cli.labels import FilterOpt, parse_labels
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown
from forkd.cli.snapshot_create import snapshot_create
from forkd.client.views import WRITING

if TYPE_CHECKING:
    import httpx

    from forkd.client import Controller

TagOpt = Annotated[
    str | None,
    typer.Option("--tag", help="Tag of the branch (default: chosen by the daemon)."),
]
ModeOpt = Annotated[
    str | None,
    typer.Option(
        "--mode",
        help="full (default), diff (only the pages that differ from the sandbox's "
        "snapshot) or live (taken as full).",
    ),
]
WaitOpt = Annotated[
    bool,
    typer.Option("--wait/--no-wait", help="--no-wait: return at once, the branch pending."),
]
CascadeOpt = Annotated[
    bool, typer.Option("--cascade", help="Delete the diff snapshots over it too.")
]
ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Compact the diff snapshots over it into full ones, keep them."),
]


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the ``snapshot`` group and ``rmi`` to ``app``; ``transport`` is for tests."""
    snapshot_app = typer.Typer(
        help="Build, list and inspect snapshots; branch a running sandbox with --from-sandbox.",
        invoke_without_command=True,
        no_args_is_help=False,
    )
    app.add_typer(snapshot_app, name="snapshot")
    daemon = functools.partial(with_connection, transport=transport)
    snapshot_app.callback(invoke_without_command=True)(daemon(snapshot_main))
    snapshot_app.command("create")(daemon(snapshot_create))
    snapshot_app.command("ls")(daemon(snapshot_ls))
    snapshot_app.command("info")(daemon(snapshot_info))
    snapshot_app.command("compact")(daemon(snapshot_compact))
    snapshot_app.command("push")(daemon(snapshot_push))
    snapshot_app.command("pull")(daemon(snapshot_pull))
    snapshot_app.command("rm")(daemon(rmi))
    app.command("rmi")(daemon(rmi))


def snapshot_main(
    conn: Connection,
    ctx: typer.Context,
    from_sandbox: Annotated[
        str | None,
        typer.Option("--from-sandbox", help="Branch this running sandbox into a snapshot."),
    ] = None,
    tag: TagOpt = None,
    mode: ModeOpt = None,
    wait: WaitOpt = True,
    diff: Annotated[bool, typer.Option("--diff", help="As --mode diff (the original's).")] = False,
    live: Annotated[bool, typer.Option("--live", help="As --mode live (the original's).")] = False,
    kernel: Annotated[str | None, typer.Option("--kernel", hidden=True)] = None,
    rootfs: Annotated[str | None, typer.Option("--rootfs", hidden=True)] = None,
) -> None:
    """Build, list and inspect snapshots; `--from-sandbox ID` branches a sandbox."""
    if ctx.invoked_subcommand is not None:
        if from_sandbox is not None:
            err.print("[bold red]error:[/] --from-sandbox takes no subcommand")
            raise typer.Exit(2)
        return
    if kernel is not None or rootfs is not None:
        raise fail(
            "the original forkd's local snapshot (--kernel, --rootfs) is made by the daemon "
            "here: forkd snapshot create --tag T --image IMAGE (a container image or a "
            "built image), or forkd from-image IMAGE --tag T",
            2,
        )
    if diff and live:
        raise typer.BadParameter("--diff or --live, not both")
    if (diff or live) and from_sandbox is None:
        raise typer.BadParameter(f"--{'diff' if diff else 'live'} requires --from-sandbox")
    if diff or live:
        if mode is not None and mode != ("diff" if diff else "live"):
            raise typer.BadParameter("--mode and --diff/--live disagree")
        mode = "diff" if diff else "live"
    if from_sandbox is None:
        out.print(ctx.get_help())
        raise typer.Exit(0)
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.branch_sandbox(from_sandbox, tag=tag, mode=mode, wait=wait)
    if conn.as_json:
        render.print_json(info)
        return
    if info.get("status") in WRITING:
        out.print(
            f"branching [green]{shown(from_sandbox)}[/] → [bold magenta]"
            f"{shown(str(info.get('tag')))}[/] in the background (writing)"
        )
        return
    out.print(
        f"branched [green]{shown(from_sandbox)}[/] → [bold magenta]"
        f"{shown(str(info.get('tag')))}[/] (paused {render.millis(info.get('pause_ms'))})"
    )


def snapshot_ls(
    conn: Connection,
    tree: Annotated[
        bool, typer.Option("--tree", help="Draw the lineage with live sandboxes.")
    ] = False,
    filter_: FilterOpt = None,
) -> None:
    """List snapshots (templates and branches)."""
    labels = parse_labels(filter_, "--filter")
    with daemon_errors(), conn.controller() as ctl:
        if tree:
            show_tree(ctl, conn.as_json)
            return
        snapshots = ctl.list_snapshots(metadata=labels)
    if conn.as_json:
        render.print_json(snapshots)
        return
    table = render.wrapping_table(
        "tag", "branched_from", "memory_mib", "image", "pause_ms", "created"
    )
    for s in snapshots:
        table.add_row(
            render.cell(s.get("tag")),
            render.cell(s.get("branched_from")),
            render.cell(s.get("memory_mib")),
            render.cell(s.get("image")),
            render.millis(s.get("pause_ms")),
            render.age(s.get("created_at_unix")),
        )
    out.print(table)
    if not snapshots:
        err.print("no snapshots yet: run 'forkd snapshot create --tag NAME'")


def snapshot_info(
    conn: Connection, tag: Annotated[str, typer.Argument(help="Snapshot tag.")]
) -> None:
    """Show a snapshot: files, sizes, lineage."""
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.snapshot_info(tag)
    if conn.as_json:
        render.print_json(info)
    else:
        out.print(render.kv_table(info))


def snapshot_compact(
    conn: Connection, tag: Annotated[str, typer.Argument(help="Snapshot tag.")]
) -> None:
    """Flatten a diff snapshot into a full one in place (its forks keep working)."""
    with daemon_errors(), conn.controller() as ctl, err.status(f"compacting {shown(tag)}"):
        info = ctl.compact_snapshot(tag)
    if conn.as_json:
        render.print_json(info)
    else:
        out.print(f"compacted [bold magenta]{shown(tag)}[/]: mode {info.get('mode')}")


RefArg = Annotated[
    str,
    typer.Argument(
        help="OCI reference: registry[:port]/repository[:tag][@digest] (without the "
        "registry only when the daemon has a --default-registry)."
    ),
]
RegistryTokenOpt = Annotated[
    str | None,
    typer.Option(
        "--registry-token",
        envvar="FORKD_REGISTRY_TOKEN",
        help="Bearer token for the registry (default: the daemon's docker config.json).",
    ),
]
InsecureRegistryOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-registry",
        help="Ask for plain HTTP; refused unless the daemon lists the registry with its "
        "--insecure-registry (a listed one is plain HTTP anyway).",
    ),
]


def _transfer_note(conn: Connection, verb: str, what: str, started: float) -> None:
    if not conn.as_json:
        err.print(f"{verb} {what} in {time.monotonic() - started:.1f} s")


def snapshot_push(
    conn: Connection,
    tag: Annotated[str, typer.Argument(help="Snapshot tag.")],
    ref: RefArg,
    token: RegistryTokenOpt = None,
    insecure: InsecureRegistryOpt = False,
    flatten: Annotated[
        bool, typer.Option("--flatten", help="Send all its memory, never a delta.")
    ] = False,
) -> None:
    """Send a snapshot to an OCI registry (only what the repository lacks goes up)."""
    started = time.monotonic()
    options = {"token": token, "insecure": insecure or None, "flatten": flatten or None}
    with daemon_errors(), conn.controller() as ctl, err.status(f"pushing {shown(tag)}"):
        result = ctl.push_snapshot(tag, ref, **options)
    if conn.as_json:
        render.print_json(result)
        return
    sent, total = result["bytes_uploaded"], result["bytes_total"]
    out.print(f"{shown(result['ref'])}@{result['digest']}", soft_wrap=True)  # one line
    _transfer_note(
        conn,
        "pushed",
        f"{sent / 2**20:.1f} of {total / 2**20:.1f} MiB ({result['encoding']})",
        started,
    )


def snapshot_pull(
    conn: Connection,
    ref: RefArg,
    tag: Annotated[
        str | None, typer.Option("--tag", help="Local tag (default: its pushed name).")
    ] = None,
    token: RegistryTokenOpt = None,
    insecure: InsecureRegistryOpt = False,
) -> None:
    """Fetch a snapshot from an OCI registry (409 if this host cannot restore it)."""
    started = time.monotonic()
    options = {"token": token, "insecure": insecure or None}
    with daemon_errors(), conn.controller() as ctl, err.status(f"pulling {shown(ref)}"):
        info = ctl.pull_snapshot(ref, tag, **options)
    if conn.as_json:
        render.print_json(info)
        return
    out.print(info["tag"])
    _transfer_note(conn, "pulled", shown(ref), started)


def rmi(
    conn: Connection,
    tags: Annotated[list[str], typer.Argument(help="Snapshot tags to delete.")],
    cascade: CascadeOpt = False,
    force: ForceOpt = False,
) -> None:
    """Delete snapshots (sandboxes forked from them keep running)."""

    def delete(tag: str) -> None:
        ctl.delete_snapshot(tag, cascade=cascade, force=force)

    with daemon_errors(), conn.controller() as ctl:
        act_on_each(tags, delete, "deleted", conn.as_json)


def show_tree(ctl: Controller, as_json: bool) -> None:
    """Print the lineage of every snapshot and live sandbox."""
    from forkd.client import ControllerError

    infos = []
    for s in ctl.list_snapshots():
        try:
            infos.append({**s, **ctl.snapshot_info(s["tag"])})
        except ControllerError as exc:
            if exc.status != 404:  # deleted meanwhile: keep what the list said
                raise
            infos.append(s)
    forest = render.lineage_forest(infos, ctl.list_sandboxes())
    if as_json:
        render.print_json(render.strip_forest(forest))
    elif not forest:
        err.print("no snapshots or sandboxes yet: run 'forkd snapshot create --tag NAME'")
    else:
        out.print(render.rich_tree(forest, title=ctl.url))
