"""The ``forkd`` command line."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from forkd import __version__
from forkd.errors import ForkdError

app = typer.Typer(
    name="forkd",
    help="Sandboxes in QEMU microVMs that fork copy-on-write and branch at any depth.",
    no_args_is_help=True,
    add_completion=False,
)
image_app = typer.Typer(help="Build and list guest images.", no_args_is_help=True)
app.add_typer(image_app, name="image")

out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


@app.command()
def version() -> None:
    """Print the forkd version."""
    out.print(__version__)


@image_app.command("build")
def image_build(
    name: Annotated[
        str, typer.Argument(help="Built-in image: python, python-data, postgres.")
    ] = "python",
    recipe: Annotated[
        Path | None,
        typer.Option("--recipe", help="Build the recipe in this directory instead."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build a guest image (cached: a second build with the same inputs is a no-op)."""
    from forkd.guest import image

    label = str(recipe) if recipe else name
    try:
        with err.status(f"building image {label}") as status:

            def progress(msg: str) -> None:
                status.update(msg)
                err.print(f"  {msg}", highlight=False)

            img = image.build(name, progress=progress, recipe_dir=recipe)
    except ForkdError as exc:
        raise _fail(str(exc)) from exc
    if as_json:
        print(json.dumps({"name": img.name, "key": img.key, "dir": str(img.dir)}))
    else:
        out.print(f"image {img.name} ready: {img.dir}", highlight=False)


@image_app.command("rm")
def image_rm(
    name: Annotated[str, typer.Argument(help="NAME (every build of it) or NAME-KEY.")],
    state_dir: Annotated[
        Path | None, typer.Option(envvar="FORKD_STATE_DIR", help="The daemon's state dir.")
    ] = None,
    snapshot_root: Annotated[
        Path | None, typer.Option(envvar="FORKD_SNAPSHOT_ROOT", help="Its snapshot root.")
    ] = None,
) -> None:
    """Delete built images; refused while a snapshot or a running VM uses one."""
    from forkd import paths
    from forkd.guest import image

    sd = state_dir or paths.state_dir()
    roots = [snapshot_root or sd / "snapshots", sd / "run"]
    try:
        removed = image.remove(name, roots)
    except ForkdError as exc:
        raise _fail(str(exc)) from exc
    for d in removed:
        out.print(f"removed {d}", highlight=False)


@image_app.command("ls")
def image_ls(as_json: JsonOpt = False) -> None:
    """List built images with their sizes."""
    from forkd.guest import image

    imgs = image.list_images()
    current = {}
    for img in imgs:
        with contextlib.suppress(ForkdError):
            current[img.name] = image.find_image(img.name).key
    rows = [
        {
            "name": img.name,
            "key": img.key,
            "current": current.get(img.name) == img.key,
            "size_bytes": img.size_bytes(),
            "kernel": img.meta.get("kernel_release"),
            "built_at_unix": img.meta.get("built_at_unix"),
            "dir": str(img.dir),
        }
        for img in imgs
    ]
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("name", "key", "current", "size", "kernel", "dir")
    for r in rows:
        table.add_row(
            r["name"], r["key"], "yes" if r["current"] else "",
            f"{r['size_bytes'] / (1 << 20):.0f} MiB", r["kernel"] or "?", r["dir"],
        )  # fmt: skip
    out.print(table)
    if not rows:
        err.print("no images built yet: run 'forkd image build'")


@app.command()
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
        typer.Option(envvar="FORKD_TOKEN_FILE", help="Require 'Authorization: Bearer <token>'."),
    ] = None,
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
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error.")] = "info",
) -> None:
    """Run the forkd daemon (HTTP API v1)."""
    from forkd import paths
    from forkd.accel import choose
    from forkd.controller.manager import Settings
    from forkd.controller.server import serve as run_server

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
        )
        run_server(settings, bind, token_file, log_level)
    except (ForkdError, ValueError) as exc:
        raise _fail(str(exc)) from exc


@app.command()
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


def main() -> None:
    from forkd import cli_remote

    cli_remote.register(app)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
