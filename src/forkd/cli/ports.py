"""``forkd port-forward`` and ``forkd url``: a sandbox's TCP ports from this host."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli.failures import daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err

if TYPE_CHECKING:
    import httpx

    from forkd.client import ControllerError


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``port-forward`` and ``url`` to ``app``; ``transport`` is for tests."""
    app.command("port-forward")(with_connection(port_forward, transport=transport))
    app.command("url")(with_connection(url, transport=transport))


def parse_ports(spec: str) -> tuple[int, int]:
    """``[LOCAL:]REMOTE`` → (local, remote); LOCAL defaults to REMOTE, 0 picks a free one."""
    local, sep, remote = spec.rpartition(":")
    try:
        remote_port = int(remote)
        local_port = int(local) if sep else remote_port
    except ValueError:
        raise fail(f"{spec!r} is not [LOCAL:]REMOTE (two port numbers)") from None
    if not 1 <= remote_port <= 65535 or not 0 <= local_port <= 65535:
        raise fail(f"{spec!r}: ports are 1-65535 (LOCAL may be 0: any free port)")
    return local_port, remote_port


def port_forward(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    ports: Annotated[
        str, typer.Argument(metavar="[LOCAL:]REMOTE", help="Guest port, and the local one.")
    ],
) -> None:
    """Forward 127.0.0.1:LOCAL to the sandbox's TCP port REMOTE, until Ctrl-C.

    Each connection is tunnelled through the daemon (a WebSocket carrying its
    bytes), so any TCP protocol works, not only HTTP.
    """
    from forkd.client.port_routes import forward_port

    local_port, remote_port = parse_ports(ports)

    def ready(port: int) -> None:
        if conn.as_json:
            line = json.dumps({"local_port": port, "remote_port": remote_port})
        else:
            line = f"Forwarding 127.0.0.1:{port} -> {sandbox_id} port {remote_port} (Ctrl-C stops)"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def refused(exc: ControllerError) -> None:
        err.print(f"[red]connection refused by the daemon:[/red] {exc.message}", markup=True)

    try:
        with daemon_errors(), conn.controller() as ctl:
            ctl.get_sandbox(sandbox_id)  # an unknown sandbox fails here, not per connection
            try:
                forward_port(ctl, sandbox_id, remote_port, local_port, ready, on_refused=refused)
            except OSError as exc:
                raise fail(f"cannot listen on 127.0.0.1:{local_port}: {exc.strerror}") from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def url(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox.")],
    port: Annotated[int, typer.Argument(help="The guest's TCP port.")],
    ttl: Annotated[
        int | None,
        typer.Option("--ttl", help="Seconds the URL works (default 3600).", show_default=False),
    ] = None,
) -> None:
    """Print a signed preview URL of the sandbox's PORT, for a browser (no token needed)."""
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.create_preview_url(sandbox_id, port, ttl)
    sys.stdout.write((json.dumps(info) if conn.as_json else info["url"]) + "\n")
