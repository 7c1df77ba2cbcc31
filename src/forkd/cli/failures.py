"""How a command fails: a red ``error:`` line on stderr and its exit code.

Exit 1: the daemon (or the host) refused; 2: the daemon could not be reached,
its token file could not be read, or the command line was wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import typer

from forkd.cli.render import err, out, print_json, shown


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` (rich markup) as an error; the exit to raise."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


@contextlib.contextmanager
def daemon_errors() -> Iterator[None]:
    """Turn a ControllerError into a red message and an exit code."""
    from forkd.client import ControllerError

    try:
        yield
    except ControllerError as exc:
        message = shown(exc.message) + (token_hint() if exc.status == 401 else "")
        raise fail(message, 2 if exc.status == 0 else 1) from None


def token_hint() -> str:
    """Where the CLI took the token it sent from: what a 401 is told."""
    from forkd import paths

    return (
        "\n(the token sent is, in order: --token-file, $FORKD_TOKEN, the file "
        "$FORKD_TOKEN_FILE names, else for a daemon on this host "
        f"{paths.token_file()}, from $FORKD_STATE_DIR: a daemon started with another "
        "--state-dir wrote its token there)"
    )


def act_on_each(
    names: list[str],
    act: Callable[[str], object],
    done_verb: str,
    as_json: bool,
    json_key: str = "removed",
) -> None:
    """``act(name)`` for each name; report each (as JSON: ``{json_key: [...], "failed":
    {name: error}}``), exit 1 if any failed.

    Stops at once with exit 2 when the daemon cannot be reached: the rest
    would fail the same way.
    """
    from forkd.client import ControllerError

    done: list[str] = []
    failed: dict[str, str] = {}
    for name in names:
        try:
            act(name)
        except ControllerError as exc:
            if exc.status == 0:
                raise fail(shown(exc.message), 2) from None
            failed[name] = exc.message
            if not as_json:  # HTTP 409: scripts of the original forkd look for the status
                said = f"HTTP {exc.status}: {exc.message}"
                err.print(f"[bold red]error:[/] {shown(name)}: {shown(said)}", highlight=False)
            continue
        done.append(name)
        if not as_json:
            out.print(f"{done_verb} {shown(name)}")
    if as_json:
        print_json({json_key: done, "failed": failed})
    if failed:
        raise typer.Exit(1)
