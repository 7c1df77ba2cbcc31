"""The options every daemon command shares: ``--url`` (``--daemon-url``), ``--token-file``,
``--daemon-token``, and ``--json`` (``--format json``, ``-o json``).

They are defined once here. :func:`with_connection` appends them to a
command's signature and hands the command a :class:`Connection` made from
them; a group callback that takes them too (``forkd snapshot --json ls``)
lends its values to its subcommands. :func:`with_options` gives a command with
many options (``forkd serve``) its options as one dataclass.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    import httpx

    from forkd.client import Controller

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        "--daemon-url",
        envvar="FORKD_URL",
        help="Daemon address: http://HOST:PORT or unix:/path/to.sock "
        "(default: http://127.0.0.1:8889).",
        show_default=False,
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="FORKD_TOKEN_FILE",
        help="File holding the daemon's bearer token.",
        show_default=False,
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--daemon-token",
        help="The daemon's bearer token itself (the original forkd's flag; FORKD_TOKEN in "
        "the environment does the same without showing it to other users in ps).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
FormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        "-o",
        help="json: print JSON (as --json); table: the default.",
        show_default=False,
    ),
]
# For a command with an -o of its own (pack -o FILE, as the original forkd's): --format only.
LongFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format", help="json: print JSON (as --json); table: the default.", show_default=False
    ),
]
FORMATS = ("json", "table")

_Options = TypeVar("_Options")


@dataclass(frozen=True)
class Connection:
    """What a daemon command was told: where the daemon is, and whether to print JSON."""

    url: str | None
    token_file: Path | None
    as_json: bool
    transport: httpx.BaseTransport | None = None  # tests answer for the daemon
    token: str | None = None  # --daemon-token

    def controller(self) -> Controller:
        """An SDK client of the daemon; ControllerError when the token file is unreadable."""
        from forkd.client import Controller, _read_token_file

        token = self.token
        if token is None and self.token_file:
            token = _read_token_file(self.token_file)
        return Controller(self.url, token=token, transport=self.transport)


def parent_param(ctx: typer.Context | None, name: str) -> Any:
    """The value an enclosing group's callback was given for ``name``, if any was."""
    parent = ctx.parent if ctx is not None else None
    while parent is not None:
        if parent.params.get(name) not in (None, False):
            return parent.params[name]
        parent = parent.parent
    return None


def _takes_short_o(hints: dict[str, Any]) -> bool:
    """Whether a command has an option spelled ``-o`` of its own."""
    for hint in hints.values():
        for meta in getattr(hint, "__metadata__", ()):
            # Under Annotated, typer takes an Option's first string as a name too.
            names = [getattr(meta, "default", None), *(getattr(meta, "param_decls", None) or ())]
            if "-o" in names:
                return True
    return False


def _shared_parameters(json_option: bool, short_o: bool = True) -> list[inspect.Parameter]:
    shared: list[tuple[str, object, object]] = [
        ("url", UrlOpt, None),
        ("token_file", TokenFileOpt, None),
        ("daemon_token", TokenOpt, None),
    ]
    if json_option:
        fmt = FormatOpt if short_o else LongFormatOpt
        shared += [("as_json", JsonOpt, False), ("output_format", fmt, None)]
    kind = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter(n, kind, default=d, annotation=a) for n, a, d in shared]


def with_connection(
    command: Callable[..., None],
    *,
    transport: httpx.BaseTransport | None = None,
    json_option: bool = True,
) -> Callable[..., None]:
    """``command(conn, *its own parameters)`` as a typer command with the shared options.

    typer reads a command's options from its signature and type hints, so the
    returned wrapper shows ``command``'s parameters (but the first) followed by
    ``--url``, ``--token-file`` and, with ``json_option``, ``--json``. An option
    left unset takes the value an enclosing group was given (``forkd snapshot
    --json ls``).
    """
    hints = typing.get_type_hints(command, include_extras=True)
    own = list(inspect.signature(command).parameters.values())[1:]
    params = [p.replace(annotation=hints[p.name]) for p in own]
    # typer hands its context to the parameter annotated typer.Context; a command
    # that wants it too must name it ``ctx``.
    passes_ctx = "ctx" in hints
    if not passes_ctx:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.insert(0, inspect.Parameter("ctx", kind, annotation=typer.Context))
    params += _shared_parameters(json_option, short_o=not _takes_short_o(hints))

    @functools.wraps(command)
    def wrapper(
        *, ctx: typer.Context, url: str | None, token_file: Path | None, **kwargs: Any
    ) -> None:
        if passes_ctx:
            kwargs["ctx"] = ctx
        as_json = kwargs.pop("as_json", False)
        fmt = kwargs.pop("output_format", None) or parent_param(ctx, "output_format")
        if fmt is not None and fmt not in FORMATS:
            raise typer.BadParameter(f"{fmt!r}: one of {', '.join(FORMATS)}", param_hint="--format")
        token = kwargs.pop("daemon_token", None) or parent_param(ctx, "daemon_token")
        conn = Connection(
            url=url or parent_param(ctx, "url"),
            token_file=token_file or parent_param(ctx, "token_file"),
            as_json=bool(as_json or parent_param(ctx, "as_json") or fmt == "json"),
            transport=transport,
            token=token,
        )
        command(conn, **kwargs)

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # read by inspect (typer); typeshed's functions declare none
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def with_options(
    command: Callable[[_Options], None], options: type[_Options]
) -> Callable[..., None]:
    """``command(options(...))`` as a typer command whose options are the fields of the
    dataclass ``options``.

    typer reads a command's options from its signature and type hints, so the
    returned wrapper shows the dataclass's fields (each annotated with its
    option, and with its default) as its parameters, in their order.
    """
    hints = typing.get_type_hints(options, include_extras=True)
    fields = inspect.signature(options).parameters.values()
    params = [p.replace(annotation=hints[p.name]) for p in fields]

    @functools.wraps(command)
    def wrapper(**given: Any) -> None:
        command(options(**given))

    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # read by inspect (typer); typeshed's functions declare none
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
