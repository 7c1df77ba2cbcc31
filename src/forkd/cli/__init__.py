"""The ``forkd`` command line: the typer app and its entry point, :func:`main`.

Each command group lives in its own module: ``images`` (``forkd image``),
``daemon`` (``serve``, ``doctor``), ``mcp`` (an MCP server), and the commands that talk to a running
daemon through the SDK: ``snapshots``, ``volumes``, ``sandboxes``, ``processes``, ``files``
(``forkd cp``), ``events``, ``ports`` (``port-forward``, ``url``). Those take
``--url`` (``$FORKD_URL``), ``--token-file`` (``$FORKD_TOKEN_FILE``) and
``--json`` (see :mod:`forkd.cli.options`); an error from the daemon prints its
message and exits 1, exit 2 when the daemon cannot be reached.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from forkd import __version__
from forkd.cli import (
    daemon,
    diffs,
    events,
    explore,
    files,
    gateway,
    images,
    mcp,
    network,
    original_commands,
    original_verbs,
    ports,
    processes,
    sandboxes,
    secrets,
    shell,
    snapshots,
    token,
    usage,
    volumes,
    webhooks,
)
from forkd.cli.render import out

if TYPE_CHECKING:
    import httpx

app = typer.Typer(
    name="forkd",
    help="Sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth.",
    no_args_is_help=True,
    add_completion=False,
)


def version() -> None:
    """Print the forkd version."""
    out.print(__version__)


def _version_option(asked: bool) -> None:
    if asked:
        version()
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_option,
            is_eager=True,
            help="Print the forkd version and exit.",
        ),
    ] = False,
) -> None:
    """Sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth."""


def add_daemon_commands(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the commands that talk to a daemon to ``app``.

    ``transport`` (tests only) is handed to every :class:`forkd.client.Controller`
    the commands make, in place of the network.
    """
    snapshots.register(app, transport=transport)
    images.register(app, transport=transport)
    volumes.register(app, transport=transport)
    secrets.register(app, transport=transport)
    webhooks.register(app, transport=transport)
    network.register(app, transport=transport)
    sandboxes.register(app, transport=transport)
    explore.register(app, transport=transport)
    diffs.register(app, transport=transport)
    processes.register(app, transport=transport)
    files.register(app, transport=transport)
    shell.register(app, transport=transport)
    events.register(app, transport=transport)
    ports.register(app, transport=transport)
    usage.register(app, transport=transport)
    original_verbs.register(app, transport=transport)
    original_commands.register(app, transport=transport)


app.command()(version)
daemon.register(app)
token.register(app)
gateway.register(app)
add_daemon_commands(app)
mcp.register(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
