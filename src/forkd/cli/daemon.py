"""``forkd serve`` runs the daemon; ``forkd doctor`` checks this host can run its VMs.

The daemon's own modules (FastAPI, uvicorn, the VM driver) are imported inside
``serve``, so the commands that only talk to a daemon never load them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from forkd.cli.failures import fail
from forkd.cli.options import JsonOpt
from forkd.cli.render import out
from forkd.errors import ForkdError


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``doctor`` to ``app``."""
    app.command()(serve)
    app.command()(doctor)


def serve(
    bind: Annotated[
        str, typer.Option(envvar="FORKD_BIND", help="HOST:PORT or unix:/path/to.sock")
    ] = "127.0.0.1:8889",
    state_dir: Annotated[
        Path | None,
        typer.Option(envvar="FORKD_STATE_DIR", help="Database, snapshots, audit log."),
    ] = None,
    snapshot_root: Annotated[
        Path | None,
        typer.Option(envvar="FORKD_SNAPSHOT_ROOT", help="Default: <state-dir>/snapshots."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            envvar="FORKD_TOKEN_FILE",
            help="Require the token in this file (default: <state-dir>/token, written "
            "on the first start, mode 0600).",
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            "--insecure-no-auth",
            help="Answer every request without a token. Anyone who reaches the address "
            "can run code in every sandbox.",
        ),
    ] = False,
    branch_concurrency: Annotated[
        int, typer.Option(envvar="FORKD_BRANCH_CONCURRENCY", min=1, max=64)
    ] = 4,
    accel: Annotated[
        str | None, typer.Option(envvar="FORKD_ACCEL", help="auto, kvm or tcg.")
    ] = None,
    kill_on_exit: Annotated[
        bool, typer.Option(help="Kill every sandbox on shutdown instead of leaving them.")
    ] = False,
    pool_size: Annotated[
        int,
        typer.Option(
            envvar="FORKD_POOL_SIZE",
            min=0,
            max=64,
            help="QEMU processes kept started per recently forked snapshot (0: none).",
        ),
    ] = 2,
    network: Annotated[
        str,
        typer.Option(
            envvar="FORKD_NETWORK",
            help="auto: a network namespace per VM when root with nftables, else QEMU's "
            "user-mode NAT without egress; netns; user.",
        ),
    ] = "auto",
    sandbox_cidr: Annotated[
        str,
        typer.Option(
            envvar="FORKD_SANDBOX_CIDR",
            help="Host-side addresses of the namespaces, a /30 per VM.",
        ),
    ] = "10.201.0.0/16",
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
) -> None:
    """Run the forkd daemon (HTTP API v1). Clients need the token in <state-dir>/token."""
    from forkd import paths
    from forkd.accel import choose
    from forkd.controller.server import serve as run_server
    from forkd.controller.settings import Settings

    sd = (state_dir or paths.state_dir()).resolve()
    snapshot_root = snapshot_root.resolve() if snapshot_root else None
    try:
        choose(accel)
        settings = Settings(
            state_dir=sd,
            snapshot_root=snapshot_root or sd / "snapshots",
            run_dir=sd / "run",
            branch_concurrency=branch_concurrency,
            accel=accel,
            kill_on_exit=kill_on_exit,
            pool_size=pool_size,
            network=network,
            sandbox_cidr=sandbox_cidr,
        )
        if network not in ("auto", "netns", "user"):
            raise ValueError(f"--network must be auto, netns or user, not {network!r}")
        run_server(settings, bind, token_file, log_level, insecure_no_auth=insecure_no_auth)
    except (ForkdError, ValueError) as exc:
        raise fail(str(exc)) from exc


def doctor(as_json: JsonOpt = False) -> None:
    """Check that this host can run forkd VMs; exit 1 with what to fix if not."""
    from forkd import doctor as doc

    checks = doc.run_checks()
    ok = doc.can_run_vms(checks)
    if as_json:
        print(json.dumps({"ok": ok, "checks": [c.__dict__ for c in checks]}))
    else:
        table = Table("check", "", "detail", "fix")
        for c in checks:
            mark = "[green]ok[/]" if c.ok else ("[red]FAIL[/]" if c.fatal else "[yellow]warn[/]")
            table.add_row(c.name, mark, c.detail, "" if c.ok else c.fix)
        out.print(table)
        out.print(
            "[green]this host can run forkd VMs[/]"
            if ok
            else "[red]this host cannot run forkd VMs[/]"
        )
    if not ok:
        raise typer.Exit(1)
