"""``forkd webhook add|ls|rm|deliveries|test``: endpoints the daemon's events go to,
signed as Standard Webhooks sign them (a receiver verifies them with the
``standardwebhooks`` library)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli import render
from forkd.cli.failures import act_on_each, daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import out
from forkd.cli.secrets import read_value

if TYPE_CHECKING:
    import httpx

EventOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--event",
        help="An event it takes (sandbox.killed, sandbox.hibernated, ...; repeat for more). "
        "Default: every one.",
    ),
]
SecretFileOpt = Annotated[
    str | None,
    typer.Option(
        "--secret-file",
        help="Its secret (whsec_ and base64), from this file ('-': standard input). "
        "Default: the daemon makes one and prints it once.",
    ),
]


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the ``webhook`` group to ``app``; ``transport`` is for tests."""
    hook_app = typer.Typer(
        help="Endpoints the daemon's events are delivered to, at least once, signed.",
        no_args_is_help=True,
    )
    app.add_typer(hook_app, name="webhook")
    hook_app.command("add")(with_connection(webhook_add, transport=transport))
    hook_app.command("ls")(with_connection(webhook_ls, transport=transport))
    hook_app.command("rm")(with_connection(webhook_rm, transport=transport))
    hook_app.command("deliveries")(with_connection(webhook_deliveries, transport=transport))
    hook_app.command("test")(with_connection(webhook_test, transport=transport))


def webhook_add(
    conn: Connection,
    endpoint: Annotated[
        str, typer.Argument(metavar="URL", help="Where the events are POSTed (http or https).")
    ],
    event: EventOpt = None,
    secret_file: SecretFileOpt = None,
    description: Annotated[str, typer.Option("--description", help="A note of yours.")] = "",
) -> None:
    """Add a webhook: the daemon's events go to URL from now on."""
    secret = read_value(secret_file, None, needed=False)
    with daemon_errors(), conn.controller() as ctl:
        info = ctl.create_webhook(endpoint, event or ["*"], secret, description)
    if conn.as_json:
        render.print_json(info)
        return
    out.print(render.kv_table(info))
    if info.get("secret"):
        out.print("keep the secret: it is not shown again (the receiver verifies with it)")


def webhook_ls(conn: Connection) -> None:
    """List webhooks: their URLs, events and deliveries waiting."""
    with daemon_errors(), conn.controller() as ctl:
        found = ctl.list_webhooks()
    if conn.as_json:
        render.print_json(found)
        return
    table = render.wrapping_table("id", "url", "events", "pending", "added")
    for h in found:
        table.add_row(
            h["id"],
            h["url"],
            ", ".join(h["events"]),
            str(h["pending"]),
            render.age(h["created_at_unix"]),
        )
    out.print(table)


def webhook_rm(
    conn: Connection,
    ids: Annotated[list[str], typer.Argument(help="Webhooks to delete.")],
) -> None:
    """Delete webhooks, and what was still to be delivered to them."""
    with conn.controller() as ctl:
        act_on_each(ids, ctl.delete_webhook, "deleted webhook", conn.as_json, "deleted")


def webhook_deliveries(
    conn: Connection,
    webhook_id: Annotated[str, typer.Argument(help="The webhook.")],
    limit: Annotated[int, typer.Option("--limit", help="How many, newest first.")] = 20,
) -> None:
    """A webhook's latest deliveries: each one's status, attempts, answer and next try."""
    with daemon_errors(), conn.controller() as ctl:
        found = ctl.webhook_deliveries(webhook_id, limit)
    if conn.as_json:
        render.print_json(found)
        return
    table = render.wrapping_table(
        "message", "event", "status", "tries", "answer", "latency", "next"
    )
    for d in found:
        answer = str(d["last_status"]) if d.get("last_status") else (d.get("last_error") or "-")
        latency = f"{d['last_latency_ms']:.0f} ms" if d.get("last_latency_ms") else "-"
        due = d.get("next_attempt_unix")
        after = f"in {max(0.0, due - time.time()):.0f} s" if due else "-"
        table.add_row(
            d["msg_id"], d["event"], d["status"], str(d["attempts"]), answer, latency, after
        )
    out.print(table)


def webhook_test(
    conn: Connection, webhook_id: Annotated[str, typer.Argument(help="The webhook.")]
) -> None:
    """Send a webhook.test message to a webhook (see it with 'forkd webhook deliveries')."""
    with daemon_errors(), conn.controller() as ctl:
        sent = ctl.test_webhook(webhook_id)
    if conn.as_json:
        render.print_json(sent)
    else:
        out.print(f"sent {sent['msg_id']}")
