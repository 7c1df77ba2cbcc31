"""``forkd image build|import|rm|ls``: the guest images snapshots boot from: forkd's
recipes built on this host, and container images imported into the daemon."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer
from rich.status import Status

from forkd.cli import render
from forkd.cli.extras import require_server
from forkd.cli.failures import daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown
from forkd.errors import ForkdError

if TYPE_CHECKING:
    import httpx


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the ``image`` group to ``app``; ``transport`` is for tests."""
    image_app = typer.Typer(
        help="Build, import and list guest images: forkd's recipes and container images.",
        no_args_is_help=True,
    )
    app.add_typer(image_app, name="image")
    daemon = functools.partial(with_connection, transport=transport)
    image_app.command("build")(daemon(image_build))
    image_app.command("import")(daemon(image_import))
    image_app.command("load")(daemon(image_load))
    image_app.command("rm")(daemon(image_rm))
    image_app.command("ls")(daemon(image_ls))


def image_build(
    conn: Connection,
    name: Annotated[
        str,
        typer.Argument(
            help="A built-in image (python, python-data, postgres), or with -t/-f or a "
            "directory: the Dockerfile build CONTEXT."
        ),
    ] = "python",
    recipe: Annotated[
        Path | None,
        typer.Option("--recipe", help="Build the recipe in this directory instead."),
    ] = None,
    tag: Annotated[
        str | None, typer.Option("-t", "--tag", help="Name the built container image (NAME:TAG).")
    ] = None,
    dockerfile: Annotated[
        Path | None,
        typer.Option("-f", "--file", help="The Dockerfile (CONTEXT/Dockerfile)."),
    ] = None,
    builder: Annotated[
        str | None,
        typer.Option("--builder", help="docker, podman or buildah (default: the first present)."),
    ] = None,
    build_arg: Annotated[
        list[str] | None, typer.Option("--build-arg", help="KEY=VALUE for the build (repeatable).")
    ] = None,
    network: Annotated[
        str | None, typer.Option("--network", help="The build's network (e.g. none).")
    ] = None,
    upload: Annotated[
        bool,
        typer.Option(
            "--upload",
            help="Send a Docker build's image to the daemon as an archive, even when the "
            "daemon is on this host (it reads this host's Docker Engine otherwise).",
        ),
    ] = False,
) -> None:
    """Build a guest image: a forkd recipe (cached: the same inputs are a no-op), or a
    Dockerfile with the host's Docker, Podman or Buildah, then imported into the daemon."""
    if tag is not None or dockerfile is not None or Path(name).is_dir():
        args = dict(a.split("=", 1) for a in build_arg or [] if "=" in a)
        _dockerfile_build(conn, Path(name), tag, dockerfile, builder, args, network, upload)
        return
    require_server("image build")
    from forkd.guest import image

    label = str(recipe) if recipe else name
    try:
        started = time.monotonic()
        with err.status(f"building image {label}") as status:
            img = image.build(name, progress=_progress(status, started), recipe_dir=recipe)
    except ForkdError as exc:
        raise fail(str(exc)) from exc
    if conn.as_json:
        print(json.dumps({"name": img.name, "key": img.key, "dir": str(img.dir)}))
    else:
        out.print(f"image {img.name} ready: {img.dir}", highlight=False)


def _progress(status: Status, started: float) -> Callable[[str], None]:
    """Each step in the status line, with the time since the start; and on a line of its
    own, but for a count going up on a terminal (``layer 2/3 … 40.0/120.0 MiB``, then
    ``80.0/120.0``): there the status line alone moves, where a log keeps each (the
    daemon says a count every few seconds or MiB)."""
    last_shape = [""]

    def say(msg: str) -> None:
        took = time.monotonic() - started
        status.update(f"{shown(msg)} ({took:.0f} s)")
        shape = _DIGITS.sub("#", msg)
        counting = shape == last_shape[0]
        last_shape[0] = shape
        if counting and err.is_terminal:
            return
        err.print(f"  [{took:6.1f} s] {msg}", highlight=False, markup=False)

    return say


_DIGITS = re.compile(r"[0-9.]+")


def _dockerfile_build(
    conn: Connection,
    context: Path,
    tag: str | None,
    dockerfile: Path | None,
    builder: str | None,
    build_args: dict[str, str],
    network: str | None,
    upload: bool,
) -> None:
    from forkd.image_import import builders

    base = re.sub(r"[^a-z0-9]+", "-", context.resolve().name.lower()).strip("-") or "image"
    name = tag or f"forkd-build/{base}:latest"
    started = time.monotonic()
    try:
        with err.status(f"building {name} from {context}") as status:
            chosen = builders.find_builder(builder)
            ref = chosen.build(
                context,
                tag=name,
                dockerfile=dockerfile,
                build_args=build_args,
                network=network,
                docker_host=None,
                progress=_progress(status, started),
            )
    except ForkdError as exc:
        raise fail(str(exc)) from exc
    try:
        if ref.startswith("oci-archive:"):  # podman, buildah: their export, sent
            load_with_progress(conn, Path(ref.removeprefix("oci-archive:")), name, started)
        elif upload or not _daemon_on_this_host(conn):  # docker: its engine is not the daemon's
            _save_and_load(conn, name, started)
        else:
            import_with_progress(conn, ref, started)
    finally:
        builders.remove_export(ref)  # podman and buildah export to a file of ours


def _daemon_on_this_host(conn: Connection) -> bool:
    """Whether the daemon is reached over loopback (it can read this host's Docker Engine)."""
    import ipaddress
    from urllib.parse import urlsplit

    with conn.controller() as ctl:
        host = urlsplit(ctl.url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _save_and_load(conn: Connection, image: str, started: float) -> None:
    """``docker save IMAGE`` from this host's engine, sent to the daemon."""
    import tempfile

    from forkd.image_import import docker_engine

    with tempfile.TemporaryDirectory(prefix="forkd-save-") as workdir:
        saved = Path(workdir) / "image.tar"
        try:
            with err.status(f"saving {image} from Docker") as status:
                say = _progress(status, started)
                docker_engine.save(
                    image, saved, progress=lambda n: status.update(f"saved {_mib(n)}")
                )
                say(f"saved {image} ({_mib(saved.stat().st_size)})")
        except ForkdError as exc:
            raise fail(str(exc)) from exc
        load_with_progress(conn, saved, image, started)


def image_import(
    conn: Connection,
    ref: Annotated[
        str,
        typer.Argument(
            help="registry[:port]/repo[:tag][@digest], docker-daemon:IMAGE, "
            "docker-archive:PATH, oci-archive:PATH[:tag] or oci:DIR[:tag] (paths on the "
            "daemon's host)"
        ),
    ],
) -> None:
    """Import a container image into the daemon (only the layers it lacks are fetched)."""
    import_with_progress(conn, ref, time.monotonic())


def image_load(
    conn: Connection,
    archive: Annotated[
        str,
        typer.Argument(
            help="A docker save, podman save or OCI archive on this host; - reads it from "
            "standard input (docker save app:1 | forkd image load -)."
        ),
    ],
    tag: Annotated[
        str | None,
        typer.Option(
            "-t",
            "--tag",
            help="NAME[:TAG]: picks the image among several, and names it (snapshot create "
            "--image NAME finds it).",
        ),
    ] = None,
) -> None:
    """Send an image archive from this host to the daemon and import it (as docker load)."""
    import sys

    source: Path | BinaryIO = sys.stdin.buffer if archive == "-" else Path(archive)
    if isinstance(source, Path) and not source.is_file():
        raise fail(f"there is no file {archive}")
    load_with_progress(conn, source, tag, time.monotonic())


def load_with_progress(
    conn: Connection, archive: Path | BinaryIO, tag: str | None, started: float
) -> dict[str, Any]:
    """Send ``archive`` to the daemon (``POST /v1/images/load``), showing each step."""
    source = str(archive) if isinstance(archive, Path) else "standard input"
    with (
        daemon_errors(),
        conn.controller() as ctl,
        err.status(f"sending {shown(source)}") as status,
    ):
        info = ctl.load_image(archive, tag, on_progress=_progress(status, started))
    if conn.as_json:
        render.print_json(info)
    else:
        err.print(
            f"loaded {shown(source)} as [bold]{shown(info['name'])}[/]"
            f"{f' ({shown(tag)})' if tag else ''} in {time.monotonic() - started:.1f} s: "
            f"stored {_mib(info.get('bytes_fetched'))}, reused {_mib(info.get('bytes_reused'))}"
        )
    return info


def import_with_progress(
    conn: Connection, ref: str, started: float, *, quiet: bool = False
) -> dict[str, Any]:
    """Import ``ref`` into the daemon, showing each step; ``quiet``: no JSON answer
    (another follows)."""
    with daemon_errors(), conn.controller() as ctl, err.status(f"importing {ref}") as status:
        info = ctl.import_image_progress(ref, _progress(status, started))
    if conn.as_json and not quiet:
        render.print_json(info)
    else:
        err.print(
            f"imported {shown(ref)} as [bold]{shown(info['name'])}[/] in "
            f"{time.monotonic() - started:.1f} s: fetched {_mib(info.get('bytes_fetched'))}, "
            f"reused {_mib(info.get('bytes_reused'))}"
        )
    return info


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.1f} MiB"


def image_rm(
    conn: Connection,
    name: Annotated[
        str,
        typer.Argument(
            help="NAME:TAG (a local name: the tag only, when it has others), "
            "NAME (every build of it) or NAME-KEY."
        ),
    ],
) -> None:
    """Remove an image through the daemon, and the layers no other image needs; refused
    (409) while a snapshot or a sandbox of any daemon sharing the cache uses it."""
    with daemon_errors(), conn.controller() as ctl:
        ctl.delete_image(name)
    if conn.as_json:
        render.print_json({"removed": name})
    else:
        out.print(f"removed {shown(name)}")


def image_ls(conn: Connection) -> None:
    """List the daemon's images: recipes and container images, their names, size on disk
    and the snapshots and sandboxes using them."""
    with daemon_errors(), conn.controller() as ctl:
        rows = ctl.list_images()
    if conn.as_json:
        render.print_json(rows)
        return
    table = render.wrapping_table("names", "image", "kind", "size", "layers (shared)", "used by")
    for r in rows:
        layers = r.get("layers")
        shared = r.get("shared_layer_bytes") or 0
        names = ", ".join(r.get("names") or []) or ("-" if r["kind"] == "recipe" else "<none>")
        table.add_row(
            render.cell(names),
            render.cell(f"{r['name']}-{r['key']}"),
            r["kind"],
            f"{(r.get('size_bytes') or 0) / (1 << 20):.0f} MiB",
            f"{layers} ({_mib(shared)} shared)" if layers else "",
            render.cell(", ".join(r.get("used_by") or [])),
        )
    out.print(table)
    if not rows:
        err.print("no images yet: run 'forkd image build' or 'forkd image import REF'")
