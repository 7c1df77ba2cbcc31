"""``forkd network ID`` (see or change what a sandbox may reach) and ``forkd egress ID``
(what it reached and was refused)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli import render
from forkd.cli.failures import daemon_errors
from forkd.cli.network_options import AllowOutOpt, DenyOutOpt
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import out, shown

if TYPE_CHECKING:
    import httpx

IdArg = Annotated[str, typer.Argument(help="Sandbox id.")]


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    app.command("network")(with_connection(network, transport=transport))
    app.command("egress")(with_connection(egress, transport=transport))


def network(
    conn: Connection,
    sandbox_id: IdArg,
    allow_out: AllowOutOpt = None,
    deny_out: DenyOutOpt = None,
    open_all: Annotated[
        bool, typer.Option("--open", help="Replace the policy with none: every public host.")
    ] = False,
) -> None:
    """Show a sandbox's network policy; with --allow-out, --deny-out or --open, replace
    it (new connections follow it at once, open ones it denies are closed)."""
    changing = bool(allow_out or deny_out or open_all)
    with daemon_errors(), conn.controller() as ctl:
        if changing:  # the rules (set through the API) stay as they are
            rules = ctl.sandbox_network(sandbox_id)["rules"] or None
            info = ctl.update_sandbox_network(sandbox_id, allow_out or [], deny_out or [], rules)
        else:
            info = ctl.sandbox_network(sandbox_id)
    if conn.as_json:
        render.print_json(info)
        return
    out.print(
        render.kv_table(
            {
                "allow out": ", ".join(info["allow_out"]) or "(every public destination)",
                "deny out": ", ".join(info["deny_out"]) or "-",
                "rules": ", ".join(info["rules"]) or "-",
                "enforced by name": "yes" if info.get("proxied") else "no (--egress-proxy off)",
                **({"connections closed": info["closed"]} if changing else {}),
            }
        )
    )


def egress(
    conn: Connection,
    sandbox_id: IdArg,
    after: Annotated[int, typer.Option("--after", min=0, help="Records after this id.")] = 0,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000)] = 100,
) -> None:
    """What a sandbox reached and was refused through the egress proxy, oldest first."""
    with daemon_errors(), conn.controller() as ctl:
        page = ctl.sandbox_egress(sandbox_id, after=after, limit=limit)
    if conn.as_json:
        render.print_json(page)
        return
    table = render.wrapping_table(
        "id", "age", "verdict", "kind", "host:port", "request", "secrets", "out", "in", "reason"
    )
    for r in page["records"]:
        request = f"{r['method']} {r['path']}" if r.get("method") else ""
        table.add_row(
            str(r["id"]),
            render.age(r["time"]),
            r["verdict"],
            r["kind"],
            shown(f"{r['host'] or r['address']}:{r['port']}"),
            shown(request),
            ", ".join(r["secrets"]),
            render.byte_size(r["bytes_out"]),
            render.byte_size(r["bytes_in"]),
            shown(r.get("reason") or ""),
        )
    out.print(table)
