"""The command-line options of a sandbox's network policy (``--allow-out``,
``--deny-out``) and a template's environment (``--env``), shared by ``snapshot
create`` and ``fork``."""

from __future__ import annotations

from typing import Annotated, Any

import typer

AllowOutOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-out",
        help="Let out only these destinations: a host name, '*.domain', an address or a "
        "CIDR (repeatable). None given: every public destination.",
    ),
]
DenyOutOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--deny-out",
        help="Never let these out, whatever --allow-out says (repeatable; '*': nothing).",
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--env",
        help="NAME=VALUE in the environment of every command (repeatable); "
        "'${secrets.NAME}' stays a placeholder in the guest and the egress proxy puts the "
        "secret in on the way out.",
    ),
]


def network_of(allow_out: list[str] | None, deny_out: list[str] | None) -> dict[str, Any] | None:
    """The request's ``network`` object; None when neither option was given."""
    if not allow_out and not deny_out:
        return None
    network: dict[str, Any] = {}
    if allow_out:
        network["allow_out"] = list(allow_out)
    if deny_out:
        network["deny_out"] = list(deny_out)
    return network


def env_of(pairs: list[str] | None) -> dict[str, str] | None:
    """``NAME=VALUE`` pairs as a dict (exit 2 on one without '='); None for none."""
    from forkd.cli.processes import parse_env

    return parse_env(pairs) if pairs else None
