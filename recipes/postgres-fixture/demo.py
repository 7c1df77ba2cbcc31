#!/usr/bin/env python3
"""postgres-fixture: a live database per sandbox, branched around a risky migration.

Agent problem: an agent must change a database (a destructive migration,
then data written by several candidate strategies) without ever touching
the fixture it started from, and without paying for a fresh database per
attempt. Here the template boots once with PostgreSQL running and a fixture
loaded; a child runs the migration; the child is branched; three
grandchildren each write their own rows on top of the migrated state. Every
sandbox has its own live server the moment it is forked.

Run: ``python recipes/postgres-fixture/demo.py`` (talks to the daemon at
FORKD_URL, or starts one). Exits 1 if any isolation check fails.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import time

from rich.console import Console
from rich.table import Table

from forkd.client import Controller, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, cleanup, daemon

console = Console()

FIXTURE = [
    "CREATE DATABASE app",
    "CREATE TABLE users (id int PRIMARY KEY, name text NOT NULL, email text NOT NULL)",
    "INSERT INTO users VALUES (1, 'ada', 'ada@example.org'), (2, 'bob', 'bob@example.org'),"
    " (3, 'cy', 'cy@example.org')",
]
MIGRATION = (
    "BEGIN; ALTER TABLE users DROP COLUMN email; DELETE FROM users WHERE id = 1;"
    " ALTER TABLE users ADD COLUMN plan text NOT NULL DEFAULT 'free'; COMMIT;"
)


def psql_argv(sql: str, db: str = "app") -> list[str]:
    return ["psql", "-U", "postgres", "-d", db, "-v", "ON_ERROR_STOP=1", "-Atc", sql]


def psql(sb: Sandbox, sql: str) -> str:
    res = sb.commands.run(psql_argv(sql), timeout=60)
    if res.exit_code != 0:
        raise RuntimeError(f"psql in {sb.id} failed ({res.exit_code}): {res.stderr.strip()}")
    return res.stdout.strip()


def rows(sb: Sandbox) -> list[str]:
    return psql(sb, "SELECT * FROM users ORDER BY id").splitlines()


def columns(sb: Sandbox) -> list[str]:
    sql = "SELECT column_name FROM information_schema.columns WHERE table_name = 'users'"
    return sorted(psql(sb, sql + " ORDER BY 1").splitlines())


def run(ctl: Controller) -> list[str]:
    """The whole scenario; returns the failed checks (empty when all passed)."""
    from forkd.guest import image as images  # the host-side image builder

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        console.print(("[green]ok[/]   " if ok else "[red]FAIL[/] ") + what)
        if not ok:
            failures.append(what)

    with console.status("guest image 'postgres' (built once, then cached)"):
        images.build("postgres")
    tag = f"pg-fixture-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        setup = [
            "psql -U postgres -v ON_ERROR_STOP=1 -c " + shlex.quote(FIXTURE[0]),
            *(
                "psql -U postgres -d app -v ON_ERROR_STOP=1 -c " + shlex.quote(s)
                for s in FIXTURE[1:]
            ),
        ]
        t0 = time.monotonic()
        with console.status("template: boot, start PostgreSQL, load the fixture, snapshot"):
            template = Snapshot.create(tag, controller=ctl, image="postgres", setup=setup)
        snaps.append(template)
        console.print(f"template {tag} ready in {(time.monotonic() - t0) * 1000:,.0f} ms")

        (child,) = template.fork(1)
        made.append(child)
        fixture_rows = rows(child)
        check(len(fixture_rows) == 3, f"the child sees the fixture: {fixture_rows}")
        psql(child, MIGRATION)
        migrated = rows(child)
        console.print(f"{child.id} ran the migration: {migrated}")

        branch = child.branch()
        snaps.append(branch)
        console.print(f"branched {child.id} → {branch.tag} (pause {branch.pause_ms} ms)")
        t0 = time.monotonic()
        grandkids = branch.fork(3)
        made += grandkids
        fork_wall = (time.monotonic() - t0) * 1000

        table = Table("grandchild", "fork", "its rows after writing")
        for i, g in enumerate(grandkids):
            psql(g, f"INSERT INTO users (id, name, plan) VALUES ({10 + i}, 'g{i}', 'pro')")
            mine = rows(g)
            table.add_row(g.id, f"{g.info.get('fork_ms') or 0:,.0f} ms", "\n".join(mine))
            check(mine == [*migrated, f"{10 + i}|g{i}|pro"], f"{g.id} sees its own row only")
            check(columns(g) == ["id", "name", "plan"], f"{g.id} has the migrated schema")
        console.print(table)
        console.print(f"3 grandchildren forked in {fork_wall:,.0f} ms wall")

        check(rows(child) == migrated, "the child is untouched by its grandchildren")
        (fresh,) = template.fork(1)
        made.append(fresh)
        check(rows(fresh) == fixture_rows, "the template still has the original fixture")
        check(columns(fresh) == ["email", "id", "name"], "the template's schema is unmigrated")
    finally:
        cleanup(made, snaps)
    return failures


def main() -> int:
    with daemon(os.environ.get("FORKD_URL", DEFAULT_URL)) as ctl:
        failures = run(ctl)
    if failures:
        console.print(f"[red]{len(failures)} check(s) failed[/]")
        return 1
    console.print("[green]all checks passed[/]: each branch saw only its own writes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
