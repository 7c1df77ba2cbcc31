#!/usr/bin/env python3
"""postgres-image: a PostgreSQL container image as a template, a live database per fork.

Agent problem: the agent's database is whatever image the team runs
(``postgres:16``, the company's own), not a forkd recipe. Here the image's
server is started before the template's snapshot, so every fork starts with
it running; one fork loads a fixture and is branched, and three forks of that
branch each write their own rows without seeing each other's, while a fresh
fork of the branch still has the fixture as loaded.

Run: ``python recipes/postgres-image/demo.py [IMAGE]`` (uses the daemon at
``FORKD_URL``, or starts one). IMAGE is any reference ``forkd image import``
takes whose command runs PostgreSQL on port 5432 and whose ``psql`` lets the
``postgres`` user in over the local socket (see README.md); default
``docker-daemon:pg-fixture:1``. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from rich.console import Console

from forkd.client import Controller, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed

console = Console(highlight=False)
DEFAULT_IMAGE = "docker-daemon:pg-fixture:1"
FIXTURE = [
    "CREATE TABLE users (id int PRIMARY KEY, name text NOT NULL)",
    "INSERT INTO users VALUES (1, 'ada'), (2, 'bob'), (3, 'cy')",
]


def psql(ctl: Controller, sb: Sandbox, sql: str) -> list[str]:
    """``sql`` run by psql in ``sb`` as the postgres user; the rows, one line each."""
    argv = ["psql", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-Atc", sql]
    res = ctl.exec_command(sb.id, argv, user="postgres", timeout_secs=60)
    if res["exit_code"] != 0:
        raise RuntimeError(f"psql in {sb.id} exited {res['exit_code']}: {res['stderr'].strip()}")
    return str(res["stdout"]).splitlines()


def run(ctl: Controller, check: Checks, image: str) -> None:
    tag = f"pg-image-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        template, took = create_template(
            ctl, tag, console, f"template: import {image}, start its server, snapshot", snaps,
            image=image, start=True, ready_port=5432, memory_mib=512,
        )  # fmt: skip
        console.print(f"template {tag} ready in {ms(took)} (the server runs in its memory)")

        (loader,) = template.fork(1)
        made.append(loader)
        for sql in FIXTURE:
            psql(ctl, loader, sql)
        fixture = psql(ctl, loader, "SELECT * FROM users ORDER BY id")
        check("the fixture is loaded", fixture == ["1|ada", "2|bob", "3|cy"], str(fixture))
        branch = loader.branch()
        snaps.append(branch)
        console.print(f"branched {loader.id} → {branch.tag} (pause {ms(branch.pause_ms)})")

        kids, took = timed(lambda: branch.fork(3))
        made += kids
        console.print(f"3 forks of the fixture in {ms(took)}, each with its own server")
        for i, kid in enumerate(kids):
            psql(ctl, kid, f"INSERT INTO users VALUES ({10 + i}, 'fork{i}')")
        for i, kid in enumerate(kids):
            rows = psql(ctl, kid, "SELECT * FROM users ORDER BY id")
            check(f"{kid.id} sees its own row only", rows == [*fixture, f"{10 + i}|fork{i}"],
                  str(rows))  # fmt: skip
        (fresh,) = branch.fork(1)
        made.append(fresh)
        rows = psql(ctl, fresh, "SELECT * FROM users ORDER BY id")
        check("the fixture snapshot still has the original fixture", rows == fixture, str(rows))
    finally:
        cleanup(made, snaps, console)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("image", nargs="?", default=DEFAULT_IMAGE, help="the PostgreSQL image")
    args = parser.parse_args()
    url = os.environ.get("FORKD_URL", DEFAULT_URL)
    return run_checks(url, console, lambda ctl, check: run(ctl, check, args.image))


if __name__ == "__main__":
    sys.exit(main())
