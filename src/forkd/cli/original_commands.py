"""The original forkd's verbs that this command line names otherwise, so its scripts and
its users' habits work unchanged where the feature exists here: ``spawn``, ``ls``,
``ping``, ``where``, ``images``, ``from-image``, ``run``, ``cleanup``, ``push``,
``pull``, ``pack``, ``unpack``, ``parent build`` and ``workspace ...``.

Each goes through this daemon (the original ran Firecracker in the CLI for some of
them). Flags the original had that mean nothing here (``--hugepages``, the netns
flags: every sandbox has a network namespace of its own) are accepted, said once,
and ignored.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from forkd.cli import render
from forkd.cli.failures import daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown

if TYPE_CHECKING:
    import httpx

CHECK, CROSS = "\u2713", "\u2717"
NO_MEANING = {
    "--per-child-netns": "every sandbox here has a network namespace of its own",
    "--hugepages": "guest memory here is the snapshot's file, mapped copy-on-write",
    "--live-fork": "forks here restore from the snapshot's file",
    "--prewarm": "forks here come from the daemon's warm pool when it has one (--pool-size)",
}


def ignored(flag: str) -> None:
    """Say once that the original's ``flag`` has no effect here, and why."""
    err.print(f"note: {flag} is accepted and has no effect: {NO_MEANING[flag]}", highlight=False)


def ignore_flags(**given: bool) -> None:
    """:func:`ignored` for each of the original's flags given (``per_child_netns=True``)."""
    for name, on in given.items():
        if on:
            ignored("--" + name.replace("_", "-"))


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    daemon = functools.partial(with_connection, transport=transport)
    app.command("spawn")(daemon(spawn))
    app.command("ls")(daemon(ls))
    app.command("ping")(daemon(ping))
    app.command("where")(where)
    app.command("images", help="The original forkd's name of 'forkd snapshot ls'.")(daemon(images))
    app.command("from-image")(daemon(from_image))
    app.command("run")(daemon(run))
    app.command("cleanup")(cleanup)
    app.command("push")(daemon(push))
    app.command("pull")(daemon(pull))
    app.command("pack")(daemon(pack))
    app.command("unpack")(daemon(unpack))
    parent = typer.Typer(help="The original forkd's root filesystem builds: images here.")
    parent.command("build")(daemon(parent_build))
    app.add_typer(parent, name="parent")
    workspace = typer.Typer(
        help="Workspaces: a named sandbox suspended to a snapshot and resumed from it.",
        no_args_is_help=True,
    )
    workspace.command("create")(daemon(workspace_create))
    workspace.command("suspend")(daemon(workspace_suspend))
    workspace.command("resume")(daemon(workspace_resume))
    workspace.command("list")(daemon(workspace_list))
    workspace.command("ls", hidden=True)(daemon(workspace_list))
    workspace.command("delete")(daemon(workspace_delete))
    app.add_typer(workspace, name="workspace")


TagOpt = Annotated[str, typer.Option("--tag", help="The snapshot.")]
NetnsOpt = Annotated[
    bool, typer.Option("--per-child-netns", help="The original's; always so here.")
]
HugeOpt = Annotated[bool, typer.Option("--hugepages", help="The original's; no effect here.")]
LiveForkOpt = Annotated[bool, typer.Option("--live-fork", help="The original's; no effect here.")]


def spawn(
    conn: Connection,
    tag: TagOpt,
    n: Annotated[int, typer.Option("-n", "--n", help="How many.", min=1, max=1000)] = 1,
    memory_limit_mib: Annotated[
        int | None, typer.Option("--memory-limit-mib", help="Memory limit per sandbox, MiB.")
    ] = None,
    per_child_netns: NetnsOpt = False,
    prewarm: Annotated[bool, typer.Option("--prewarm", help="The original's.")] = False,
    live_fork: LiveForkOpt = False,
    hugepages: HugeOpt = False,
) -> None:
    """Fork sandboxes from a snapshot through the daemon, one line each (the original
    forkd's spawn; forkd fork is the same with more options)."""
    ignore_flags(
        per_child_netns=per_child_netns, prewarm=prewarm, live_fork=live_fork, hugepages=hugepages
    )
    with daemon_errors(), conn.controller() as ctl:
        made = ctl.spawn_sandboxes(tag, n=n, memory_limit_mib=memory_limit_mib)
    if conn.as_json:
        render.print_json(made)
        return
    for sb in made:
        out.print(
            f"  {CHECK} {shown(sb['id'])}  guest={shown(sb.get('guest_addr') or '-')}  "
            f"netns={shown(sb.get('netns') or '-')}",
            highlight=False,
        )


def ls(conn: Connection) -> None:
    """List live sandboxes (the original forkd's ls; forkd ps filters and shows more)."""
    with daemon_errors(), conn.controller() as ctl:
        listed = ctl.list_sandboxes()
    if conn.as_json:
        render.print_json(listed)
        return
    if not listed:
        err.print("no live sandboxes")
        return
    table = render.wrapping_table("ID", "SNAPSHOT", "STATE", "PID", "NETNS", "GUEST_ADDR")
    for sb in listed:
        table.add_row(
            *(
                render.cell(sb.get(k))
                for k in ("id", "snapshot_tag", "state", "pid", "netns", "guest_addr")
            )
        )
    out.print(table)
    out.print(f"\n  {len(listed)} sandbox{'es' if len(listed) != 1 else ''}")


def ping(
    conn: Connection,
    sandbox_id: Annotated[str | None, typer.Argument(metavar="[ID]", help="The sandbox.")] = None,
    child: Annotated[
        str | None, typer.Option("--child", "--target", help="The sandbox (the original's flags).")
    ] = None,
) -> None:
    """Ask a sandbox's guest agent whether it answers; prints its answer as JSON."""
    target = sandbox_id or child
    if target is None:
        raise typer.BadParameter("name the sandbox: forkd ping ID")
    with daemon_errors(), conn.controller() as ctl:
        render.print_json(ctl.ping_sandbox(target))


def where(
    state_dir: Annotated[
        str | None, typer.Option("--state-dir", envvar="FORKD_STATE_DIR", help="The daemon's.")
    ] = None,
) -> None:
    """Print where a daemon on this host keeps its state (snapshots under snapshots/)."""
    from forkd import paths

    print(state_dir or paths.state_dir())


def images(conn: Connection) -> None:
    """List the daemon's snapshots (the original forkd's images)."""
    from forkd.cli.snapshots import snapshot_ls

    snapshot_ls(conn)


def from_image(
    conn: Connection,
    image: Annotated[str, typer.Argument(help="A container image or a built image's name.")],
    tag: TagOpt,
    mem_size_mib: Annotated[
        int | None, typer.Option("--mem-size-mib", help="Guest RAM, MiB.", min=1)
    ] = None,
    extra: Annotated[
        list[str] | None, typer.Option("--extra", help="A Debian package to add (repeatable).")
    ] = None,
    boot_wait_secs: Annotated[
        float | None, typer.Option("--boot-wait-secs", help="The original's; unused.")
    ] = None,
) -> None:
    """Make snapshot --tag from a container image (forkd snapshot create --image)."""
    setup = [f"apt-get install -y --no-install-recommends {' '.join(extra)}"] if extra else None
    with daemon_errors(), conn.controller() as ctl, err.status(f"making {shown(tag)}"):
        info = ctl.create_snapshot(tag, image=image, memory_mib=mem_size_mib, setup=setup)
    if conn.as_json:
        render.print_json(info)
        return
    err.print(f"{CHECK} snapshot {shown(tag)} ready.\nnext: forkd fork --tag {shown(tag)} -n 1")


def run(
    conn: Connection,
    image: Annotated[str, typer.Option("--image", help="A container image or built image.")],
    cmd: Annotated[list[str], typer.Argument(metavar="-- CMD...", help="What to run.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds, for CMD.")] = 600,
) -> None:
    """Run CMD in a sandbox made from --image, print its output and exit with its code;
    the template (run-<image>) is kept for the next run, the sandbox is removed."""
    import re

    tag = "run-" + re.sub(r"[^a-z0-9_.-]+", "-", image.lower()).strip("-.")[:56]
    with daemon_errors(), conn.controller() as ctl:
        if not any(s.get("tag") == tag for s in ctl.list_snapshots()):
            with err.status(f"making {tag} from {shown(image)}"):
                ctl.create_snapshot(tag, image=image)
        (sb,) = ctl.spawn_sandboxes(tag, n=1)
        try:
            ran = ctl.exec_command(sb["id"], cmd, timeout_secs=timeout)
        finally:
            ctl.kill_sandbox(sb["id"])
    sys.stdout.write(str(ran.get("stdout") or ""))
    sys.stderr.write(str(ran.get("stderr") or ""))
    raise typer.Exit(int(ran.get("exit_code") or 0))


def cleanup(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="The original's.")] = False,
) -> None:
    """The original forkd left work directories under /tmp; this daemon removes its own
    leftovers (staging, VMs, namespaces) when it starts: nothing to clean here."""
    print("nothing to clean: the daemon removes its own leftovers when it starts")


def push(
    conn: Connection,
    tag: TagOpt,
    ref: Annotated[str, typer.Argument(help="An OCI registry reference (registry/repo:tag).")],
) -> None:
    """Send a snapshot to an OCI registry (forkd snapshot push TAG REF)."""
    from forkd.cli.snapshots import snapshot_push

    snapshot_push(conn, tag, ref)


def pull(
    conn: Connection,
    ref: Annotated[str, typer.Argument(help="An OCI registry reference (registry/repo:tag).")],
    tag: Annotated[str | None, typer.Option("--tag", help="Its tag here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="The original's; no effect.")] = False,
) -> None:
    """Fetch a snapshot from an OCI registry (forkd snapshot pull REF)."""
    from forkd.cli.snapshots import snapshot_pull

    snapshot_pull(conn, ref, tag)


def pack(
    conn: Connection,
    tag: TagOpt,
    out: Annotated[
        Path | None, typer.Option("-o", "--out", help="The file (default: TAG.forkd-snapshot.tar).")
    ] = None,
    description: Annotated[
        str | None, typer.Option("--description", help="The original's.")
    ] = None,
    base_image: Annotated[str | None, typer.Option("--base-image", help="The original's.")] = None,
) -> None:
    """Write a snapshot to a file, an OCI archive (a diff's bases in it too), to unpack on
    any host: forkd unpack FILE (or push it to a registry with forkd push)."""
    if description is not None or base_image is not None:
        err.print(
            "note: --description and --base-image are accepted and not stored: the "
            "archive records the snapshot's image and machine itself"
        )
    target = out or Path(f"{tag}.forkd-snapshot.tar")
    with daemon_errors(), conn.controller() as ctl, err.status(f"packing {shown(tag)}"):
        size = ctl.export_snapshot(tag, target)
    if conn.as_json:
        render.print_json({"tag": tag, "path": str(target), "bytes": size})
        return
    err.print(
        f"{CHECK} wrote {shown(str(target))} ({size / (1 << 20):.1f} MiB): snapshot "
        f"{shown(tag)} as an OCI archive; forkd unpack {shown(str(target))} on any host",
        highlight=False,
    )


def unpack(
    conn: Connection,
    path: Annotated[Path, typer.Argument(help="A file forkd pack wrote.")],
    tag: Annotated[
        str | None, typer.Option("--tag", help="Its name here (default: the packed one).")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace a snapshot of that name, once the archive "
            "is in (unpacked under another name first).",
        ),
    ] = False,
) -> None:
    """Make a snapshot from a file forkd pack wrote (every piece checked)."""
    if not path.is_file():
        raise fail(f"there is no file {shown(str(path))}")
    with daemon_errors(), conn.controller() as ctl:
        name = tag or (packed_tag(path) if force else None)
        taken = name is not None and any(s.get("tag") == name for s in ctl.list_snapshots())
        if force and name is None:
            raise fail(
                "--force needs the snapshot's name: give --tag (the archive names "
                "no one tag this command can read)"
            )
        if force and taken:
            assert name is not None
            info = _unpack_replacing(ctl, path, name)
        else:
            with err.status(f"unpacking {shown(str(path))}") as status:
                info = ctl.import_snapshot(path, tag, status.update)
    if conn.as_json:
        render.print_json(info)
        return
    err.print(
        f"{CHECK} unpacked tag '{shown(info['tag'])}': forkd fork --tag {shown(info['tag'])} -n 1",
        highlight=False,
    )


def _unpack_replacing(ctl: Any, path: Path, name: str) -> dict[str, Any]:
    """``unpack --force`` of a taken ``name``: the archive unpacked under a name of its
    own first (all of it checked, this host able to restore it), and only then the
    old snapshot deleted and the new one copied to ``name``; the old one stays when
    anything before its deletion fails."""
    import secrets

    staged = f"{name[:48]}-unpack-{secrets.token_hex(3)}"
    with err.status(f"unpacking {shown(str(path))} as {staged}") as status:
        ctl.import_snapshot(path, staged, status.update)
    try:
        ctl.delete_snapshot(name)
        err.print(f"deleted snapshot {shown(name)} (--force)")
        return dict(ctl.compact_snapshot(staged, to=name))
    finally:
        with contextlib.suppress(Exception):
            ctl.delete_snapshot(staged)


def packed_tag(path: Path) -> str | None:
    """The one tag a pack file's index.json names, read here as the daemon reads it (a
    plain tar, one index.json), or None."""
    import json
    import tarfile

    with contextlib.suppress(OSError, tarfile.TarError, ValueError, KeyError, TypeError):
        with tarfile.open(path, mode="r:") as tar:  # no decompression: the daemon does none
            found = [m for m in tar.getmembers() if m.name.lstrip("./") == "index.json"]
            if len(found) != 1 or not found[0].isfile() or found[0].size > (1 << 20):
                return None
            handle = tar.extractfile(found[0])
            index = json.loads(handle.read()) if handle is not None else {}
        names = {
            m["annotations"]["org.opencontainers.image.ref.name"]
            for m in index.get("manifests", [])
            if "annotations" in m
        }
        return next(iter(names)) if len(names) == 1 else None
    return None


def parent_build(
    conn: Connection,
    image: Annotated[str, typer.Argument(help="A container image reference.")],
) -> None:
    """Import a container image as a guest image (forkd image import)."""
    from forkd.cli.images import image_import

    image_import(conn, image)


# ------------------------------------------------------------------ workspaces


def _workspace_line(w: dict[str, Any]) -> str:
    return (
        f"{w.get('name', ''):<24} {w.get('status', ''):<10} "
        f"source={w.get('source_snapshot_tag') or '-':<24} "
        f"state={w.get('current_state_tag') or '-':<24} live={w.get('live_sandbox_id') or '-'}"
    )


def _show_workspace(conn: Connection, w: dict[str, Any]) -> None:
    if conn.as_json:
        render.print_json(w)
    else:
        out.print(shown(_workspace_line(w)), highlight=False)


def workspace_create(
    conn: Connection,
    name: Annotated[str, typer.Argument(help="The workspace's name.")],
    snapshot: Annotated[str, typer.Option("--snapshot", help="The snapshot it starts from.")],
    memory_limit_mib: Annotated[
        int | None, typer.Option("--memory-limit-mib", help="Its memory limit, MiB.")
    ] = None,
    per_child_netns: NetnsOpt = False,
) -> None:
    """Make a workspace: a sandbox forked from --snapshot, under a name."""
    if per_child_netns:
        ignored("--per-child-netns")
    with daemon_errors(), conn.controller() as ctl:
        made = ctl.create_workspace(name, snapshot, memory_limit_mib=memory_limit_mib)
    _show_workspace(conn, made)


def workspace_suspend(
    conn: Connection,
    name: Annotated[str, typer.Argument(help="The workspace.")],
    diff: Annotated[bool, typer.Option("--diff", help="The original's; taken as asked.")] = False,
) -> None:
    """Snapshot a workspace's sandbox and stop it."""
    with daemon_errors(), conn.controller() as ctl:
        _show_workspace(conn, ctl.suspend_workspace(name))


def workspace_resume(
    conn: Connection, name: Annotated[str, typer.Argument(help="The workspace.")]
) -> None:
    """Fork a suspended workspace's sandbox again from its snapshot."""
    with daemon_errors(), conn.controller() as ctl:
        _show_workspace(conn, ctl.resume_workspace(name))


def workspace_list(conn: Connection) -> None:
    """List workspaces."""
    with daemon_errors(), conn.controller() as ctl:
        listed = ctl.list_workspaces()
    if conn.as_json:
        render.print_json(listed)
        return
    for w in listed:
        out.print(shown(_workspace_line(w)), highlight=False)
    if not listed:
        out.print("(no workspaces)")


def workspace_delete(
    conn: Connection, name: Annotated[str, typer.Argument(help="The workspace.")]
) -> None:
    """Delete a workspace (its sandbox and snapshots)."""
    with daemon_errors(), conn.controller() as ctl:
        ctl.delete_workspace(name)
    if conn.as_json:
        render.print_json({"deleted": name})
    else:
        out.print(f"deleted workspace '{shown(name)}'")


__all__ = ["fail", "ignored", "register"]
