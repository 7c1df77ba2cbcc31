"""``forkd cp``: copy files and directories between this host and a sandbox."""

from __future__ import annotations

import functools
import posixpath
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from forkd.archive import ArchiveError
from forkd.cli import render
from forkd.cli.failures import daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown

if TYPE_CHECKING:
    import httpx

    from forkd.client import Sandbox

# ID:/path: a sandbox id (no '/' in it), a colon, an absolute path in the sandbox.
_REMOTE = re.compile(r"^([A-Za-z0-9_.-]+):(/.*)$")
ProgressFn = Callable[[int, "int | None"], None]


@dataclass(frozen=True)
class Remote:
    sandbox_id: str
    path: str


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``forkd cp`` to ``app``; ``transport`` is for tests."""
    app.command("cp")(functools.partial(with_connection, transport=transport)(cp))


def parse_side(text: str) -> Remote | Path:
    """``ID:/path`` is a path in sandbox ID; anything else a local path."""
    m = _REMOTE.match(text)
    return Remote(m[1], m[2]) if m else Path(text)


def cp(
    conn: Connection,
    src: Annotated[str, typer.Argument(metavar="SRC", help="ID:/path or a local path.")],
    dst: Annotated[str, typer.Argument(metavar="DST", help="ID:/path or a local path.")],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Copy a file or a directory (recursively, as a tar stream) between this host
    and a sandbox: forkd cp ./data ID:/root/data, forkd cp ID:/var/log/app.log .

    As cp -r does: a directory copied onto an existing directory goes inside it."""
    source, dest = parse_side(src), parse_side(dst)
    if isinstance(source, Remote) == isinstance(dest, Remote):
        raise fail("one of SRC and DST must be ID:/path and the other a local path", 2)
    with daemon_errors(), conn.controller() as ctl:
        from forkd.client import Sandbox

        remote = source if isinstance(source, Remote) else dest
        assert isinstance(remote, Remote)
        sb = Sandbox.connect(remote.sandbox_id, controller=ctl)
        with _progress(quiet or conn.as_json) as progress, _local_errors():
            if isinstance(source, Path):
                assert isinstance(dest, Remote)
                where, moved = _upload(sb, source, dest.path, progress)
            else:
                assert isinstance(dest, Path)
                where, moved = _download(sb, source.path, dest, progress)
    if conn.as_json:
        render.print_json({"src": src, "dst": where, "bytes": moved})
    elif not quiet:
        out.print(f"copied {moved} bytes to {shown(where)}", highlight=False)


def _remote_kind(sb: Sandbox, path: str) -> str | None:
    """ "dir", "file" or None (missing) for a path in the sandbox."""
    from forkd.client import ControllerError

    try:
        sb.files.list(path)
        return "dir"
    except ControllerError as exc:
        if exc.status == 404:
            return None
        if exc.status == 400:  # not a directory
            return "file"
        raise


def _upload(sb: Sandbox, local: Path, path: str, progress: ProgressFn) -> tuple[str, int]:
    if not local.exists():
        raise fail(f"{shown(str(local))} does not exist", 2)
    kind = _remote_kind(sb, path)
    name = local.resolve().name
    if local.is_dir():
        if kind == "file":
            raise fail(f"{shown(path)} is a file in the sandbox, {shown(str(local))} a directory")
        target = posixpath.join(path, name) if kind == "dir" else path
    else:
        target = posixpath.join(path, name) if kind == "dir" or path.endswith("/") else path
    written = sb.files.upload(local, target, progress=progress)
    return f"{sb.id}:{target}", int(written["size"])


def _download(sb: Sandbox, path: str, local: Path, progress: ProgressFn) -> tuple[str, int]:
    kind = _remote_kind(sb, path)
    if kind is None:
        raise fail(f"{shown(path)} does not exist in sandbox {shown(sb.id)}")
    name = posixpath.basename(path.rstrip("/")) or "root"
    target = local / name if local.is_dir() else local
    if kind == "dir" and target.exists() and not target.is_dir():
        raise fail(f"{shown(str(target))} is a file, {shown(path)} a directory")
    moved = sb.files.download(path, target, directory=kind == "dir", progress=progress)
    return str(target), moved


@contextmanager
def _local_errors() -> Iterator[None]:
    """This host's side failing (a directory missing, no permission, a tar member the
    extraction refuses): a red message and exit 1, not a traceback."""
    try:
        yield
    except (OSError, ArchiveError) as exc:
        raise fail(shown(str(exc))) from None


@contextmanager
def _progress(quiet: bool) -> Iterator[ProgressFn]:
    """A progress bar on stderr (none when ``quiet``), and the function that moves it."""
    if quiet:
        yield lambda moved, total: None
        return
    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("copy", total=None)

        def advance(moved: int, total: int | None) -> None:
            bar.update(task, completed=moved, total=total)

        yield advance
