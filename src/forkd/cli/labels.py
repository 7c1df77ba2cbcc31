"""Labels (``metadata``) on the command line: ``--label KEY=VALUE`` to set them,
``--filter KEY=VALUE`` to list by them; both repeatable."""

from __future__ import annotations

from typing import Annotated

import typer

LabelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--label", metavar="KEY=VALUE", help="Label it (repeatable); see --filter of ls and ps."
    ),
]
FilterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        metavar="KEY=VALUE",
        help="Only those with this label (repeatable: all of them).",
    ),
]


def parse_labels(pairs: list[str] | None, option: str = "--label") -> dict[str, str] | None:
    """``["k=v", ...]`` as a dict; None when none were given; a usage error for a pair
    without ``=`` or with an empty key (the daemon checks the rest)."""
    if not pairs:
        return None
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint=option)
        labels[key] = value
    return labels
