"""A progress bar for ``forkd fork -n N`` on a terminal: children counted as they start.

The fork is one request, answered when all N run (or none). Meanwhile the
daemon publishes a ``created`` event for each child that runs, so a second
connection to ``/v1/events`` counts them. Nothing is shown in ``--json`` mode
or when stderr is not a terminal.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forkd.cli.options import Connection
from forkd.cli.render import err


@contextlib.contextmanager
def fork_progress(conn: Connection, tag: str, n: int, quiet: bool) -> Iterator[None]:
    if quiet or not err.is_terminal:
        yield
        return
    bar = Progress(
        TextColumn(f"forking from {tag}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True,
    )  # fmt: skip
    task = bar.add_task("fork", total=n)
    watcher = conn.controller()
    stop = threading.Event()

    def count() -> None:
        with contextlib.suppress(Exception):  # a progress display never fails the fork
            for event in watcher.events(types="created", reconnect_s=2.0):
                if stop.is_set():
                    return
                if event.get("snapshot_tag") == tag:
                    bar.advance(task)

    thread = threading.Thread(target=count, name="fork-progress", daemon=True)
    with bar:
        thread.start()
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                watcher.close()  # ends the event stream the thread reads
            thread.join(1.0)
