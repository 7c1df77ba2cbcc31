#!/usr/bin/env python3
"""Dockerfile patch search: a repository's own image, forked once per candidate patch.

An agent fixing a failing test suite often has several candidate patches and
no way to know which is right but to apply each and run the tests. In one
checkout they have to run one after another, each undone before the next; in
fresh containers, each pays for the start and the cold caches. Here the
repository's Dockerfile is built with the host's Docker (as ``forkd image build``
does) and imported; a template runs the suite once, so the interpreter, the
project and its bytecode are in the guest's page cache when it is snapshotted;
then one fork per candidate applies its patch and runs the suite, all at once,
and the script says which patch makes the suite pass and how long each fork took.

Run: ``python recipes/dockerfile-patch-search/demo.py --base IMAGE`` (IMAGE: a
Debian-like image with python3 that your Docker has; uses the daemon at
``FORKD_URL``, or starts one for the duration of the demo).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from forkd import Controller, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed

console = Console(highlight=False)

HERE = Path(__file__).resolve().parent
PROJECT = HERE / "project"  # the repository: its Dockerfile, code, tests
PATCHES = sorted((HERE / "patches").glob("*.diff"))  # the candidates, one fork each
EXPECTED_WINNER = "4-pre-releases.diff"
TESTS = "python3 -m unittest discover -s tests -t ."
# The template runs the suite once (it fails: that is the bug) and keeps its verdict:
# the interpreter, the project and its bytecode are then warm in every fork.
WARM_UP = f"{TESTS} > /tmp/baseline.txt 2>&1; echo $? > /tmp/baseline.rc"
TEST_TIMEOUT_SECS = 120.0


@dataclass(frozen=True)
class Outcome:
    patch: str
    sandbox: Sandbox
    applied: bool
    passed: bool
    summary: str  # unittest's last line, or why the patch did not apply
    fork_ms: float | None  # the daemon's, for this child
    run_ms: float  # writing the patch, applying it, running the suite


def summary_of(output: str) -> str:
    """``Ran 7 tests ...: OK`` or ``FAILED (failures=2)`` from unittest's output."""
    ran = re.search(r"^Ran (\d+) tests?", output, re.M)
    verdict = [line for line in output.strip().splitlines() if line.startswith(("OK", "FAILED"))]
    return f"{ran.group(1) if ran else '?'} tests: {verdict[-1] if verdict else 'no verdict'}"


def try_patch(sandbox: Sandbox, patch: Path) -> Outcome:
    """In ``sandbox``: apply ``patch`` to the project, then run the suite."""
    started = time.monotonic()
    sandbox.files.write("/tmp/candidate.diff", patch.read_bytes())
    applied = sandbox.commands.run(["python3", "tools/apply_patch.py", "/tmp/candidate.diff"])
    fork_ms = sandbox.info.get("fork_ms")
    if not applied.ok:
        took = (time.monotonic() - started) * 1000
        return Outcome(patch.name, sandbox, False, False, applied.stderr.strip(), fork_ms, took)
    res = sandbox.commands.run(f"{TESTS} 2>&1", timeout=TEST_TIMEOUT_SECS)
    took = (time.monotonic() - started) * 1000
    return Outcome(patch.name, sandbox, True, res.ok, summary_of(res.stdout), fork_ms, took)


def build_image(args: argparse.Namespace) -> str:
    """The project's image built by the host's builder; the reference to import."""
    from forkd.image_import import builders

    builder = builders.find_builder(args.builder)
    console.print(
        f"[bold]building[/] {args.tag} from {PROJECT} with {builder.name} (FROM {args.base})"
    )

    def say(line: str) -> None:
        console.print(f"  [dim]{escape(line)}[/]")

    ref, took = timed(
        lambda: builder.build(
            PROJECT, tag=args.tag, build_args={"BASE": args.base}, network="none", progress=say
        )
    )
    console.print(f"[bold]built[/] {ref} in {ms(took)}")
    return ref


def run(ctl: Controller, args: argparse.Namespace, check: Checks) -> None:
    prefix = f"ps-{secrets.token_hex(3)}"
    ref = args.image or build_image(args)
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        with console.status(f"importing {ref}") as status:
            image, import_ms = timed(
                lambda: ctl.import_image_progress(
                    ref, lambda msg: status.update(f"importing {ref}: {escape(msg)}")
                )
            )
        console.print(
            f"[bold]imported[/] {ref} as {image['name']} in {ms(import_ms)} "
            f"({image['bytes_fetched'] / 2**20:.1f} MiB read, {image['bytes_reused'] / 2**20:.1f} "
            "MiB already held)"
        )
        console.print(f"(the image stays cached after the demo: forkd image rm {image['name']})")
        doing = f"template {prefix}: boot the image, run the suite once, snapshot"
        template, build_ms = create_template(
            ctl, prefix, console, doing, snaps, image=ref, memory_mib=args.memory, setup=[WARM_UP]
        )
        console.print(f"[bold]template[/] {prefix} ready in {ms(build_ms)}")

        n = len(PATCHES)
        forks, fork_ms = timed(lambda: template.fork(n))
        made.extend(forks)
        console.print(f"[bold]forked[/] {n} sandboxes in {ms(fork_ms)}: one per candidate patch")
        baseline = forks[0].files.read("/tmp/baseline.txt").decode(errors="replace")
        rc = forks[0].files.read("/tmp/baseline.rc").decode().strip()
        console.print(f"unpatched suite (run in the template): {summary_of(baseline)}")
        check("the unpatched suite fails (the bug is real)", rc not in ("", "0"), f"exit {rc}")

        with ThreadPoolExecutor(n) as pool:
            outcomes, all_ms = timed(lambda: list(pool.map(try_patch, forks, PATCHES)))
        table = Table(
            "patch",
            "applies",
            "suite",
            "fork",
            "apply + tests",
            "sandbox",
            title=f"{n} candidate patches, one fork each, run at once",
        )
        for o in outcomes:
            table.add_row(
                o.patch,
                "yes" if o.applied else "[red]no[/]",
                ("[green]" if o.passed else "[red]") + escape(o.summary) + "[/]",
                ms(o.fork_ms),
                ms(o.run_ms),
                o.sandbox.id,
            )
        console.print(table)
        winners = [o for o in outcomes if o.passed]
        console.print(f"all {n} candidates tried in {ms(all_ms)} (wall, at once)")
        for o in winners:
            console.print(f"[bold green]winner:[/] {o.patch} makes the suite pass ({o.summary})")
        check(
            "exactly one patch makes the suite pass",
            len(winners) == 1,
            f"passing: {[o.patch for o in winners]}",
        )
        check(
            f"the passing patch is {EXPECTED_WINNER}",
            [o.patch for o in winners] == [EXPECTED_WINNER],
        )
        check("a stale patch is refused, nothing changed", any(not o.applied for o in outcomes))

        # The forks were copies: the template still holds the unpatched project.
        (fresh,) = template.fork(1)
        made.append(fresh)
        res = fresh.commands.run(f"{TESTS} 2>&1", timeout=TEST_TIMEOUT_SECS)
        check(
            "a fresh fork of the template is unpatched (its suite still fails)",
            not res.ok,
            summary_of(res.stdout),
        )
    finally:
        cleanup(made, snaps, console, report=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base",
        default="python:3.12-slim-bookworm",
        help="the Dockerfile's FROM: any Debian-like image with python3",
    )
    parser.add_argument("--tag", default="forkd-recipes/patch-search:1", help="the built image")
    parser.add_argument("--builder", help="docker, podman or buildah (default: the first present)")
    parser.add_argument("--image", help="import this reference instead of building the Dockerfile")
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args()
    return run_checks(args.url, console, lambda ctl, check: run(ctl, args, check))


if __name__ == "__main__":
    sys.exit(main())
