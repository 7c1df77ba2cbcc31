"""A progress bar for ``forkd fork -n N`` on a terminal: children counted as they start.

The fork is one request, answered when all N run (or none). Meanwhile the
daemon publishes a ``created`` event for each child that runs, so a second
connection to ``/v1/events`` counts them. Nothing is shown in ``--json`` mode
or when stderr is not a terminal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forkd.cli.event_watch import watching
from forkd.cli.options import Connection
from forkd.cli.render import err


@contextlib.contextmanager
def fork_progress(conn: Connection, tag: str, n: int, quiet: bool) -> Iterator[None]:
    if quiet or not err.is_terminal:
        yield
        return
    bar = Progress(
        TextColumn(f"forking from {tag}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    task = bar.add_task("fork", total=n)

    def count(event: dict[str, Any]) -> None:
        if event.get("snapshot_tag") == tag:
            bar.advance(task)

    with bar, watching(conn, "created", count):
        yield
