#!/usr/bin/env python3
"""Best of N: set a repository up once, then try every candidate patch on a copy of it.

A repository whose tests need an expensive setup first (its dependencies installed, a
data file built) has a failing suite and several candidate patches. Trying each in a
fresh checkout pays the setup once per candidate; one checkout has to try them one
after another, each undone before the next. Here the setup runs once, in one sandbox;
then ``sandbox.explore`` branches it, forks one copy per patch, applies each patch in
its copy, scores it by the number of tests that pass, keeps the best copy running and
kills the rest. The script prints the ranking, the winner's diff (what its patch
changed on top of the set-up checkout) and what the setup would have cost per
candidate.

Run: ``python recipes/best-of-n/demo.py`` (uses the daemon at ``FORKD_URL``, or starts
one for the duration of the demo).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import secrets
import sys
import tarfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from forkd import Controller, Sandbox, Snapshot
from forkd.client import ExploreResult
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed

console = Console(highlight=False)

HERE = Path(__file__).resolve().parent
PROJECT = HERE / "project"  # the repository: storefinder, its tests, setup.sh, vendor/
PATCHES = sorted((HERE / "patches").glob("*.diff"))  # the candidates, one copy each
# Applies a unified diff with the standard library (the image has no patch or git):
# the patch-search recipe's own tool, uploaded beside the checkout.
APPLY_PATCH = HERE.parent / "dockerfile-patch-search" / "project" / "tools" / "apply_patch.py"
EXPECTED_WINNER = "4-parse-sort-lookup.diff"
BUILT = {".deps", "cells.json", "__pycache__"}  # what setup.sh and Python make: not uploaded

WORK = "/work"
CHECKOUT = f"{WORK}/project"
# -B: the suite leaves no bytecode in the checkout, so a diff shows only the patch.
TESTS = ["python3", "-B", "-m", "unittest", "discover", "-s", "tests", "-t", "."]
SCORE = {"exec": ["python3", "-B", "tools/score.py"], "cwd": CHECKOUT}
SETUP_TIMEOUT_SECS = 1800.0
SUITE_TIMEOUT_SECS = 300.0


def upload_archive() -> bytes:
    """The checkout (without what setup.sh builds), the patches and apply_patch.py, as
    a tar to extract in /work."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(PROJECT, "project", filter=lambda m: None if BUILT & set(m.name.split("/")) else m)
        for patch in PATCHES:
            tar.add(patch, f"patches/{patch.name}")
        tar.add(APPLY_PATCH, "tools/apply_patch.py")
    return buf.getvalue()


def run_suite(sb: Sandbox) -> tuple[bool, int, str]:
    """The suite in ``sb``'s checkout: whether it passed, how many tests ran, the verdict."""
    res = sb.commands.run(TESTS, cwd=CHECKOUT, timeout=SUITE_TIMEOUT_SECS)
    ran = re.search(r"^Ran (\d+) tests?", res.stderr, re.M)
    verdict = [line for line in res.stderr.splitlines() if line.startswith(("OK", "FAILED"))]
    total = int(ran.group(1)) if ran else 0
    return res.ok, total, f"{total} tests: {verdict[-1] if verdict else 'no verdict'}"


def set_up(sb: Sandbox, samples: int) -> float:
    """Upload the checkout into ``sb`` and run its setup; the setup's time in ms."""
    archive = upload_archive()
    sb.controller.upload_file(sb.id, WORK, archive, tar=True)
    console.print(
        f"[bold]uploaded[/] {PROJECT.name}/, {len(PATCHES)} patches and apply_patch.py to "
        f"{WORK} ({len(archive) / 1024:.0f} KiB tar)"
    )

    def say(text: str) -> None:
        for line in text.splitlines():
            console.print(f"  [dim]{escape(line)}[/]")

    with console.status(f"setup: sh setup.sh {samples} (install the dependency, build the data)"):
        res, took = timed(
            lambda: sb.commands.run(
                ["sh", "setup.sh", str(samples)], cwd=CHECKOUT, timeout=SETUP_TIMEOUT_SECS,
                on_stdout=say, on_stderr=say,
            )
        )  # fmt: skip
    if not res.ok:
        raise RuntimeError(f"setup.sh exited {res.exit_code}: {res.stderr.strip()[-2000:]}")
    console.print(f"[bold]setup[/] done in {ms(took)}: the expensive part, paid once")
    return took


def variant(patch: Path) -> dict[str, object]:
    """The explore step that applies ``patch`` to the checkout."""
    return {"exec": ["python3", f"{WORK}/tools/apply_patch.py", f"{WORK}/patches/{patch.name}"],
            "cwd": CHECKOUT}  # fmt: skip


def show_ranking(res: ExploreResult, total: int, unpatched: str) -> None:
    table = Table(
        "rank", "patch", "score", "exit", "error", "kept", "apply + score", "sandbox",
        title=f"{len(res.results)} candidate patches, one copy each, best first",
        caption=f"score: the tests that pass (unpatched: {unpatched} / {total})",
    )  # fmt: skip
    for rank, r in enumerate(res.results, 1):
        table.add_row(
            str(rank),
            PATCHES[r.index].name,
            "-" if r.score is None else f"{r.score:g} / {total}",
            "-" if r.exit_code is None else str(r.exit_code),
            "" if r.error is None else f"[red]{escape(r.error.strip())}[/]",
            "[green]yes[/]" if r.kept else "no",
            ms(r.duration_ms),
            r.sandbox_id or "-",
        )
    console.print(table)


def patch_targets(patch: Path) -> set[str]:
    """The files a unified diff changes, under the checkout."""
    names = re.findall(r"^\+\+\+ (?:b/)?(\S+)", patch.read_text(), re.M)
    return {f"{CHECKOUT}/{name}" for name in names}


def show_diff(text: str) -> None:
    for line in text.splitlines():
        style = "green" if line.startswith("+") else "red" if line.startswith("-") else ""
        style = "bold" if line.startswith(("+++", "---")) else style
        console.print(f"[{style}]{escape(line)}[/]" if style else escape(line))


def prepare(
    ctl: Controller, args: argparse.Namespace, check: Checks, prefix: str,
    made: list[Sandbox], snaps: list[Snapshot],
) -> tuple[Sandbox, float, int, str]:  # fmt: skip
    """A template, one sandbox forked of it, the checkout set up in it; the sandbox,
    the setup's time, the number of tests and how many pass unpatched."""
    doing = f"template {prefix}: boot the python image, snapshot"
    template, build_ms = create_template(
        ctl, prefix, console, doing, snaps, image="python", memory_mib=args.memory, egress="none"
    )
    console.print(f"[bold]template[/] {prefix} ready in {ms(build_ms)}")
    (source,), fork_ms = timed(lambda: template.fork(1))
    made.append(source)
    console.print(f"[bold]{source.id}[/]: the checkout's sandbox, forked in {ms(fork_ms)}")
    setup_ms = set_up(source, args.samples)
    ok, total, verdict = run_suite(source)
    score = source.commands.run(SCORE["exec"], cwd=CHECKOUT, timeout=SUITE_TIMEOUT_SECS)
    baseline = score.stdout.strip().splitlines()[-1] if score.ok and score.stdout.strip() else "?"
    console.print(f"unpatched suite: {verdict}; {baseline} of {total} pass (tools/score.py)")
    check("the unpatched suite fails (the bugs are real)", not ok and total > 0, verdict)
    return source, setup_ms, total, baseline


def search(source: Sandbox, prefix: str, timeout: float) -> tuple[ExploreResult, float]:
    """``source.explore``: one copy per patch, each applied and scored, the best kept."""
    n = len(PATCHES)
    with console.status(f"explore: branch {source.id}, fork {n} copies, apply and score each"):
        return timed(
            lambda: source.explore(
                [variant(p) for p in PATCHES], score=SCORE, keep=1, tag=f"{prefix}-explore",
                timeout_secs=timeout,
            )
        )  # fmt: skip


def judge(ctl: Controller, res: ExploreResult, total: int, source: Sandbox, check: Checks) -> None:
    """The winner, its diff against the set-up checkout, and what the others did."""
    best = res.best
    if best is None or best.sandbox_id is None:
        check("some patch scored", False, "every variant failed")
        return
    name = PATCHES[best.index].name
    console.print(
        f"[bold green]winner:[/] {name} ({best.score:g} of {total} tests pass), "
        f"running on in {best.sandbox_id}"
    )
    check(
        f"the winner is {EXPECTED_WINNER}, all {total} tests passing",
        name == EXPECTED_WINNER and best.score == total,
        f"{name}: {best.score:g}",
    )
    refused = [r for r in res.results if "does not apply" in (r.error or "")]
    check(
        "the patch that does not apply has an error and no score",
        len(refused) == 1 and refused[0].score is None and not refused[0].kept,
        f"{[(PATCHES[r.index].name, r.error) for r in refused]}",
    )
    check("only the winner was kept", [r.index for r in res.kept] == [best.index])

    winner = Sandbox(sandbox_id=best.sandbox_id, controller=ctl)
    text, diff_ms = timed(lambda: winner.diff(CHECKOUT, format="patch"))
    console.print(
        f"[bold]the winner's diff[/]: winner.diff({CHECKOUT!r}, format='patch'), against "
        f"{res.branch}, the set-up checkout it was forked from ({ms(diff_ms)}):"
    )
    show_diff(text)
    changed = {c.path for c in winner.diff(CHECKOUT).changes}
    check(
        "the winner's diff touches only the files its patch touches",
        changed == patch_targets(PATCHES[best.index]),
        f"changed: {sorted(changed)}",
    )
    ok, _, verdict = run_suite(source)
    since = source.diff(CHECKOUT, against=res.branch).changes
    check(
        f"the source is untouched: its suite still fails ({verdict}), nothing changed",
        not ok and not since,
        f"changed since the branch: {[c.path for c in since]}",
    )


def leftovers(ctl: Controller, prefix: str) -> list[str]:
    """The snapshots and sandboxes of this run that still exist."""
    tags = [s["tag"] for s in ctl.list_snapshots() if s["tag"].startswith(prefix)]
    ids = [sb["id"] for sb in ctl.list_sandboxes()
           if (sb.get("snapshot_tag") or "").startswith(prefix)]  # fmt: skip
    return tags + ids


def run(ctl: Controller, args: argparse.Namespace, check: Checks) -> None:
    prefix = f"bn-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        source, setup_ms, total, unpatched = prepare(ctl, args, check, prefix, made, snaps)
        res, wall_ms = search(source, prefix, args.timeout)
        if res.branch_kept:  # the kept copy's memory is mapped from it
            snaps.append(Snapshot(res.branch, controller=ctl))
        made.extend(Sandbox(sandbox_id=r.sandbox_id, controller=ctl)
                    for r in res.kept if r.sandbox_id)  # fmt: skip
        show_ranking(res, total, unpatched)
        n = len(PATCHES)
        console.print(
            f"explore {res.branch}: {source.id} paused {ms(res.pause_ms)} for the branch, "
            f"{n} copies forked in {ms(res.fork_ms)}, all applied and scored in "
            f"{ms(res.duration_ms)} ({ms(wall_ms)} seen from here)"
        )
        console.print(
            f"setup paid once: {ms(setup_ms)}. A fresh checkout per candidate would pay it "
            f"{n} times, {ms(n * setup_ms)}, before the first test ran; the whole explore "
            f"took {ms(wall_ms)}."
        )
        judge(ctl, res, total, source, check)
    finally:
        cleanup(made, snaps, console, report=True)
    left = leftovers(ctl, prefix)
    check(
        "nothing left behind (sandboxes, the template, the explore's branch)", not left, f"{left}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples", type=int, default=3,
        help="the data file's grid points per cell side: the setup's cost grows with its square",
    )  # fmt: skip
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--timeout", type=float, default=600.0, help="the explore's, in seconds")
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args()
    return run_checks(args.url, console, lambda ctl, check: run(ctl, args, check))


if __name__ == "__main__":
    sys.exit(main())
