"""``forkd volume create|ls|rm``: persistent volumes that fork copy-on-write."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli import render
from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import out, shown

if TYPE_CHECKING:
    import httpx


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the ``volume`` group to ``app``; ``transport`` is for tests."""
    volume_app = typer.Typer(
        help="Persistent volumes that fork copy-on-write.", no_args_is_help=True
    )
    app.add_typer(volume_app, name="volume")
    volume_app.command("create")(with_connection(volume_create, transport=transport))
    volume_app.command("ls")(with_connection(volume_ls, transport=transport))
    volume_app.command("rm")(with_connection(volume_rm, transport=transport, json_option=False))


def volume_create(
    conn: Connection,
    name: Annotated[str, typer.Argument(help="Volume name.")],
    size: Annotated[str, typer.Option("--size", help="e.g. 512M, 1G.")] = "1G",
    from_dir: Annotated[
        Path | None, typer.Option("--from", help="Copy this local directory in.")
    ] = None,
) -> None:
    """Create an ext4 volume (empty, or a copy of a local directory)."""
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.create_volume(name, size, from_dir=from_dir)
    if conn.as_json:
        render.print_json(info)
    else:
        out.print(render.kv_table(info))


def volume_ls(conn: Connection) -> None:
    """List volumes with their size, disk use and users."""
    with daemon_errors(), conn.controller() as ctl:
        vols = ctl.list_volumes()
    if conn.as_json:
        render.print_json(vols)
        return
    table = render.wrapping_table("name", "size", "on disk", "layers", "used by")
    for v in vols:
        table.add_row(
            v["name"],
            f"{v['size_bytes'] >> 20} MiB",
            f"{v['allocated_bytes'] >> 20} MiB",
            str(v.get("layers", 0)),
            ", ".join(v.get("used_by") or []),
        )
    out.print(table)


def volume_rm(
    conn: Connection, names: Annotated[list[str], typer.Argument(help="Volumes to delete.")]
) -> None:
    """Delete volumes (refused while a snapshot or sandbox uses one)."""
    with daemon_errors(), conn.controller() as ctl:
        for name in names:
            ctl.delete_volume(name)
            out.print(f"removed volume {shown(name)}")
