"""The options of a stop hook (``--on-stop``), on ``forkd fork`` and ``forkd snapshot
create``."""

from __future__ import annotations

from typing import Annotated

import typer

OnStopOpt = Annotated[
    str | None,
    typer.Option(
        "--on-stop",
        metavar="LINE",
        help="A command (/bin/sh -c) each sandbox runs before the daemon stops it: rm "
        "without --force, its timeout, a hibernation. Default: the snapshot's.",
    ),
]
OnStopTimeoutOpt = Annotated[
    float | None,
    typer.Option("--on-stop-timeout", help="How long --on-stop may run, in s (default 10)."),
]
