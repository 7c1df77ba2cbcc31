"""``forkd mcp``: an MCP server (stdio, or streamable HTTP) over the daemon's sandboxes.

The server itself is :mod:`forkd.mcp_server`; it needs the ``mcp`` extra
(``pip install 'forkd[mcp]'``), and says so in one line when it is missing.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Annotated

import typer

from forkd.cli.options import Connection, with_connection

HttpOpt = Annotated[
    str | None,
    typer.Option(
        "--http",
        help="Serve streamable HTTP at HOST:PORT (path /mcp) instead of stdio; every "
        "request needs the daemon's bearer token.",
        show_default=False,
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``mcp`` to ``app``."""
    app.command("mcp")(with_connection(mcp, json_option=False))


def _token(conn: Connection) -> str | None:
    """The token this server sends the daemon (and wants from its HTTP clients)."""
    from forkd.client.connection import Address, _resolve_token

    return Address.parse(conn.url).bearer(_resolve_token(None, conn.token_file))


def mcp(conn: Connection, http: HttpOpt = None) -> None:
    """Serve the daemon's sandboxes as MCP tools: create, fork, exec, run Python, files,
    branch, list, kill, and the lineage tree (forkd://tree)."""
    if importlib.util.find_spec("mcp") is None:
        print("forkd mcp needs the mcp extra: pip install 'forkd[mcp]'", file=sys.stderr)
        raise typer.Exit(1)
    from forkd import mcp_server
    from forkd.client import AsyncController

    token = _token(conn)
    server = mcp_server.build(lambda: AsyncController(conn.url, token=token))
    if http is None:
        server.run("stdio")
        return
    import uvicorn

    host, _, port = http.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise typer.BadParameter(f"--http wants HOST:PORT, not {http!r}")
    app = server.streamable_http_app(host=host)
    if token:
        app = mcp_server.bearer_only(app, token)
    uvicorn.run(app, host=host, port=int(port), log_level="warning")


def original_main() -> None:
    """``forkd-mcp``: the original forkd MCP server's command, for client configs that name
    it. Serves stdio, reaching the daemon at ``FORKD_URL`` with ``FORKD_TOKEN`` (or the
    token file), as ``forkd mcp`` does; takes ``forkd mcp``'s options too."""
    app = typer.Typer(add_completion=False)
    app.command()(with_connection(mcp, json_option=False))
    app(prog_name="forkd-mcp")
