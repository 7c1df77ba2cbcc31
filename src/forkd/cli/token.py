"""``forkd token``: the daemon's bearer token, or with ``--e2b`` the API key of E2B's
form that its E2B port takes (for E2B's SDKs: E2B_API_KEY)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from forkd import paths
from forkd.cli.failures import fail
from forkd.cli.render import out
from forkd.e2b_key import e2b_key

E2bOpt = Annotated[
    bool, typer.Option("--e2b", help="Print the key of E2B's form (e2b_...) the token stands for.")
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(envvar="FORKD_STATE_DIR", help="The daemon's state directory (its token file)."),
]


def register(app: typer.Typer) -> None:
    app.command()(token)


def token(e2b: E2bOpt = False, state_dir: StateDirOpt = None) -> None:
    """Print the daemon's token (from <state-dir>/token), for clients and E2B's SDKs."""
    where = paths.token_file(state_dir)
    try:
        text = where.read_text().strip()
    except OSError as exc:
        raise fail(f"cannot read the daemon's token at {where}: {exc.strerror}") from exc
    if not text:
        raise fail(f"{where} is empty: start the daemon once (forkd serve) to make a token")
    out.print(e2b_key(text) if e2b else text, markup=False, highlight=False)
