"""``forkd image build|rm|ls``: the guest images snapshots boot from, built on this host."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from forkd.cli.extras import require_server
from forkd.cli.failures import fail
from forkd.cli.options import JsonOpt
from forkd.cli.render import err, out
from forkd.errors import ForkdError


def register(app: typer.Typer) -> None:
    """Add the ``image`` group to ``app``."""
    image_app = typer.Typer(help="Build and list guest images.", no_args_is_help=True)
    app.add_typer(image_app, name="image")
    image_app.callback()(lambda: require_server("image"))
    image_app.command("build")(image_build)
    image_app.command("rm")(image_rm)
    image_app.command("ls")(image_ls)


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
        started = time.monotonic()
        with err.status(f"building image {label}") as status:

            def progress(msg: str) -> None:  # each step, with the time since the start
                took = time.monotonic() - started
                status.update(f"{msg} ({took:.0f} s)")
                err.print(f"  [{took:6.1f} s] {msg}", highlight=False)

            img = image.build(name, progress=progress, recipe_dir=recipe)
    except ForkdError as exc:
        raise fail(str(exc)) from exc
    if as_json:
        print(json.dumps({"name": img.name, "key": img.key, "dir": str(img.dir)}))
    else:
        out.print(f"image {img.name} ready: {img.dir}", highlight=False)


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
        raise fail(str(exc)) from exc
    for d in removed:
        out.print(f"removed {d}", highlight=False)


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
