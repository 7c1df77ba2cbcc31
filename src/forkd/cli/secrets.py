"""``forkd secret create|update|ls|rm``: credentials the egress proxy injects.

A value is never an argument (it would show in ``ps`` and in shell history):
it comes from ``--value-file`` (``-``: standard input), ``--from-env VAR``, or
a hidden prompt on a terminal. One trailing newline is dropped, as ``echo`` and
editors add one.
"""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from forkd import limits
from forkd.cli import render
from forkd.cli.failures import act_on_each, daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import out, shown

if TYPE_CHECKING:
    import httpx

READ_LIMIT = 4 * limits.MAX_SECRET_VALUE_CHARS  # the daemon says what is too long

ValueFileOpt = Annotated[
    str | None,
    typer.Option("--value-file", help="Read the value from this file ('-': standard input)."),
]
FromEnvOpt = Annotated[
    str | None, typer.Option("--from-env", help="Take the value from this environment variable.")
]
HostsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--host",
        help="A host the value may be sent to: a name or '*.domain' (repeat for more).",
    ),
]


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the ``secret`` group to ``app``; ``transport`` is for tests."""
    secret_app = typer.Typer(
        help="Credentials injected by the egress proxy: a sandbox holds only "
        "${secrets.NAME}, the daemon sends the value to the secret's hosts.",
        no_args_is_help=True,
    )
    app.add_typer(secret_app, name="secret")
    secret_app.command("create")(with_connection(secret_create, transport=transport))
    secret_app.command("update")(with_connection(secret_update, transport=transport))
    secret_app.command("ls")(with_connection(secret_ls, transport=transport))
    secret_app.command("rm")(with_connection(secret_rm, transport=transport))


def _strip_newline(text: str) -> str:
    return text.removesuffix("\n").removesuffix("\r")


def read_value(value_file: str | None, from_env: str | None, *, needed: bool) -> str | None:
    """The value the options name; a hidden prompt on a terminal when ``needed`` and none
    is named; None when not ``needed`` and none is named."""
    if value_file is not None and from_env is not None:
        raise fail("give --value-file or --from-env, not both", 2)
    if from_env is not None:
        if from_env not in os.environ:
            raise fail(f"${shown(from_env)} is not set", 2)
        return os.environ[from_env]
    if value_file == "-":
        return _strip_newline(sys.stdin.read(READ_LIMIT))
    if value_file is not None:
        try:
            with Path(value_file).open(encoding="utf-8", errors="strict") as f:
                return _strip_newline(f.read(READ_LIMIT))
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"cannot read {shown(value_file)}: {shown(exc)}", 2) from None
    if not needed:
        return None
    if not sys.stdin.isatty():
        raise fail("no value: give --value-file FILE, --value-file - (stdin) or --from-env", 2)
    return getpass.getpass("value (not shown): ")


def _print_info(conn: Connection, info: dict[str, object]) -> None:
    if conn.as_json:
        render.print_json(info)
    else:
        out.print(render.kv_table(info))


def secret_create(
    conn: Connection,
    name: Annotated[str, typer.Argument(help="The name ${secrets.NAME} places it by.")],
    hosts: HostsOpt = None,
    value_file: ValueFileOpt = None,
    from_env: FromEnvOpt = None,
) -> None:
    """Create a secret: its value is sealed in the daemon and sent only to its hosts."""
    if not hosts:
        raise fail("name the hosts the value may go to: --host api.example.com", 2)
    value = read_value(value_file, from_env, needed=True)
    assert value is not None
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.create_secret(name, value, hosts)
    _print_info(conn, info)


def secret_update(
    conn: Connection,
    name: Annotated[str, typer.Argument(help="The secret to change.")],
    hosts: HostsOpt = None,
    value_file: ValueFileOpt = None,
    from_env: FromEnvOpt = None,
) -> None:
    """Rotate a secret's value and/or replace its hosts; the next request uses them."""
    value = read_value(value_file, from_env, needed=not hosts)
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.update_secret(name, value, hosts or None)
    _print_info(conn, info)


def secret_ls(conn: Connection) -> None:
    """List secrets: names, hosts and when each was last used (never a value)."""
    with daemon_errors(), conn.controller() as ctl:
        found = ctl.list_secrets()
    if conn.as_json:
        render.print_json(found)
        return
    table = render.wrapping_table("name", "hosts", "updated", "last used")
    for s in found:
        used = render.age(s["last_used_unix"]) if s.get("last_used_unix") else "never"
        table.add_row(s["name"], ", ".join(s["hosts"]), render.age(s["updated_at_unix"]), used)
    out.print(table)


def secret_rm(
    conn: Connection,
    names: Annotated[list[str], typer.Argument(help="Secrets to delete.")],
    force: Annotated[
        bool, typer.Option("--force", help="Even while running sandboxes' rules name it.")
    ] = False,
) -> None:
    """Delete secrets (refused while running sandboxes' network rules name one)."""
    with conn.controller() as ctl:
        act_on_each(
            names,
            lambda n: ctl.delete_secret(n, force=force),
            "deleted secret",
            conn.as_json,
            "deleted",
        )
