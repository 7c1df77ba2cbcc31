"""What ``forkd snapshot create`` shows while the daemon builds the template: the
daemon's ``snapshot_progress`` events of that tag (each step; while a started service
is waited for, what is waited for and the service's latest output line), followed on
a second connection beside the create request."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rich.status import Status

from forkd.cli.event_watch import watching
from forkd.cli.options import Connection
from forkd.cli.render import err, shown

OUTPUT_SHOWN = 120  # characters of the service's output line in the status line


@contextlib.contextmanager
def following_build(conn: Connection, tag: str, status: Status) -> Iterator[None]:
    """While the block runs, each build step of snapshot ``tag`` on a line of its own and
    what it waits for in ``status``; on a terminal only (as fork's progress bar), never
    in --json mode."""
    if conn.as_json or not err.is_terminal:
        yield
        return
    steps: list[str] = []

    def show(event: dict[str, Any]) -> None:
        if event.get("snapshot_tag") != tag:
            return
        message, output = str(event.get("message", "")), str(event.get("output", ""))
        step = str(event.get("step", ""))
        if not steps or steps[-1] != step:
            steps.append(step)
            err.print(f"  {shown(message)}", highlight=False)
        tail = f" | {shown(output[-OUTPUT_SHOWN:])}" if output else ""
        status.update(f"{shown(message)}{tail}")

    with watching(conn, "snapshot_progress", show):
        yield
