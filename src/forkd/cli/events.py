"""``forkd events``: the daemon's lifecycle events, one line each, until Ctrl-C."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection

if TYPE_CHECKING:
    import httpx

COMMON = ("id", "type", "time", "sandbox_id", "snapshot_tag")


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``events`` to ``app``; ``transport`` is for tests."""
    app.command("events")(with_connection(events, transport=transport))


def line(event: dict[str, Any]) -> str:
    """``TIME TYPE SUBJECT key=value...``: one event, human readable."""
    subject = " ".join(str(event[k]) for k in ("sandbox_id", "snapshot_tag") if event.get(k))
    rest = " ".join(
        f"{k}={v if isinstance(v, str) else json.dumps(v)}"
        for k, v in event.items()
        if k not in COMMON
    )
    return " ".join(
        p for p in (event.get("time", ""), f"{event.get('type', ''):<16}", subject, rest) if p
    )


def events(
    conn: Connection,
    types: Annotated[
        list[str] | None,
        typer.Option("--type", "-t", help="Only events of this type (repeat for more)."),
    ] = None,
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", help="Only this sandbox's events.")
    ] = None,
    since: Annotated[
        int | None,
        typer.Option("--since", help="Replay the events after this id first (0: all kept)."),
    ] = None,
) -> None:
    """Print lifecycle events as they happen (created, paused, killed, ...) until Ctrl-C."""
    try:
        with daemon_errors(), conn.controller() as ctl:
            for event in ctl.events(types=types or None, sandbox_id=sandbox, since=since):
                text = json.dumps(event, separators=(",", ":")) if conn.as_json else line(event)
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
