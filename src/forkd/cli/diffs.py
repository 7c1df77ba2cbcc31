"""``forkd diff``: what a sandbox changed, against its snapshot, a snapshot or a sandbox."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from forkd.cli import render
from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown

if TYPE_CHECKING:
    import httpx

MARKS = {"added": "[green]+[/]", "modified": "[yellow]~[/]", "removed": "[red]-[/]"}


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``diff`` to ``app``; ``transport`` is for tests."""
    app.command("diff")(with_connection(diff, transport=transport))


def diff(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")],
    path: Annotated[str, typer.Option("--path", help="The directory to compare.")] = "/",
    against: Annotated[
        str | None,
        typer.Option("--against", help="A snapshot tag or sandbox id (default: its snapshot)."),
    ] = None,
    patch: Annotated[
        bool, typer.Option("--patch", help="Print a unified diff of the text files.")
    ] = False,
    tar: Annotated[
        Path | None,
        typer.Option("--tar", help="Write the added and modified files to this tar ('-': stdout)."),
    ] = None,
) -> None:
    """Show what a sandbox changed since its snapshot (or against another)."""
    if patch and tar is not None:
        raise typer.BadParameter("give --patch or --tar, not both")
    with daemon_errors(), conn.controller() as ctl:
        if patch:
            sys.stdout.write(ctl.diff_patch(sandbox_id, path, against))
            return
        if tar is not None:
            data = ctl.diff_tar(sandbox_id, path, against)
            if str(tar) == "-":
                sys.stdout.buffer.write(data)
            else:
                tar.write_bytes(data)
                err.print(f"wrote {len(data)} bytes to {shown(str(tar))}")
            return
        res = ctl.diff_sandbox(sandbox_id, path, against)
    if conn.as_json:
        render.print_json(res.raw)
        return
    table = Table(box=None, show_header=False)
    for c in res.changes:
        size = "" if c.kind == "dir" else str(c.size)
        table.add_row(MARKS[c.change], shown(c.path), c.kind, size, f"{c.mode:o}")
    if res.changes:
        out.print(table)
    counts = {k: len(res.of(k)) for k in ("added", "modified", "removed")}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    err.print(
        f"{shown(sandbox_id)} against {res.against_kind} {shown(res.against)}: "
        f"{summary} in {res.duration_ms:.0f} ms"
    )
    if res.truncated:
        err.print("[yellow]more changes than a diff lists: give a smaller --path[/]")
