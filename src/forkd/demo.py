"""The forkd demo: template → children → branch → grandchildren, through the daemon.

Run it with ``./dev.sh demo`` (installs everything first) or
``python -m forkd.demo``. It talks to the daemon at ``FORKD_URL`` (default
``http://127.0.0.1:8889``) and starts one for the duration of the demo if
none answers there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from forkd.client import Controller, ControllerError, Sandbox, Snapshot
from forkd.launcher import DaemonProcess, DaemonStartError

console = Console()
DEFAULT_URL = "http://127.0.0.1:8889"


def ms(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f} ms"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and how long it took, in milliseconds."""
    started = time.monotonic()
    value = fn()
    return value, (time.monotonic() - started) * 1000


class Checks:
    """Prints one line per check and remembers the failures."""

    def __init__(self, out: Console | None = None) -> None:
        self.console = out or console
        self.passed = 0
        self.failed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            self.console.print(f"  [green]PASS[/] {name}")
        else:
            self.failed.append(name)
            self.console.print(f"  [bold red]FAIL[/] {name}" + (f": {detail}" if detail else ""))
        return ok

    def report(self) -> int:
        """Print the outcome of all checks; the exit status: 0 if all passed, else 1."""
        if self.failed:
            self.console.print(
                f"[bold red]FAILED[/]: {len(self.failed)} of "
                f"{len(self.failed) + self.passed} checks: {', '.join(self.failed)}"
            )
            return 1
        self.console.print(f"[bold green]all {self.passed} checks passed[/]")
        return 0


def create_template(
    ctl: Controller, tag: str, out: Console, status: str, snapshots: list[Snapshot], **options: Any
) -> tuple[Snapshot, float]:
    """``Snapshot.create(tag, **options)`` with ``status`` showing on ``out``.

    The snapshot is appended to ``snapshots`` (the demo's list for :func:`cleanup`);
    returns it and how long it took, in milliseconds.
    """
    with out.status(status):
        template, took = timed(lambda: Snapshot.create(tag, controller=ctl, **options))
    snapshots.append(template)
    return template, took


def cleanup(
    sandboxes: Iterable[Sandbox],
    snapshots: Iterable[Snapshot],
    out: Console | None = None,
    *,
    report: bool = False,
) -> None:
    """Kill ``sandboxes``, then delete ``snapshots`` newest first, ignoring ControllerError.

    With ``out``, a "cleaning up" status shows on that console meanwhile, and with
    ``report`` too, a "cleaned up N sandboxes and M snapshots" line follows.
    """
    sandboxes, snapshots = list(sandboxes), list(snapshots)
    with out.status("cleaning up") if out else contextlib.nullcontext():
        for sb in sandboxes:
            with contextlib.suppress(ControllerError):
                sb.kill()
        for snap in reversed(snapshots):
            with contextlib.suppress(ControllerError):
                snap.delete()
    if out and report:
        out.print(f"cleaned up {len(sandboxes)} sandboxes and {len(snapshots)} snapshots")


def _answers(ctl: Controller) -> bool:
    """Whether a daemon answers ``/healthz`` (which needs no token) through ``ctl``."""
    try:
        ctl.health()
    except ControllerError:
        return False
    return True


def _check_token(ctl: Controller, url: str) -> None:
    """Exit with what to do when the daemon at ``url`` refuses this demo's token."""
    try:
        ctl.list_snapshots()
    except ControllerError as exc:
        if exc.status != 401:
            raise
        raise SystemExit(
            f"the daemon at {url} wants its token: run the demo with FORKD_TOKEN_FILE=<its "
            "--token-file>, or FORKD_STATE_DIR=<its --state-dir> to read <state-dir>/token"
        ) from None


@contextlib.contextmanager
def daemon(url: str) -> Iterator[Controller]:
    """The daemon at ``url``, or one started here (and stopped afterwards).

    A running daemon's token is found as the SDK finds it (``FORKD_TOKEN``,
    ``FORKD_TOKEN_FILE``, else ``<state-dir>/token``). A daemon started here
    writes its own token in its state directory, and the demo reads it there.
    """
    with Controller(url) as ctl:
        if _answers(ctl):
            console.print(f"[bold]daemon[/] already running at {url}")
            _check_token(ctl, url)
            yield ctl
            return
    state = Path(tempfile.mkdtemp(prefix="forkd-demo-", dir="/tmp"))
    proc = DaemonProcess(state, bind=url.removeprefix("http://"))
    try:
        with console.status(f"starting a daemon at {url} (state in {state})"):
            try:
                proc.start("--kill-on-exit")
            except DaemonStartError:
                raise SystemExit(f"the daemon did not start; see {proc.log}") from None
        console.print(f"[bold]daemon[/] started at {url} for this demo")
        with Controller(url, token_file=proc.token_path) as ctl:
            yield ctl
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)


def run_checks(url: str, out: Console, body: Callable[[Controller, Checks], None]) -> int:
    """Run ``body`` against the daemon at ``url`` with a fresh :class:`Checks`.

    Any exception is reported on ``out`` as a failed demo, not a traceback.
    Returns the exit status: 0 if every check passed, else 1.
    """
    check = Checks(out)
    try:
        with daemon(url) as ctl:
            body(ctl, check)
    except Exception as exc:  # report any failure as a failed demo, not a traceback
        out.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}")
        return 1
    return check.report()


TEMPLATE_SETUP = ["mkdir -p /work && echo 'written by setup' > /work/README.txt"]
TEMPLATE_WARMUP = (
    "import json, sqlite3, statistics\n"
    "db = sqlite3.connect(':memory:')\n"
    "db.execute('create table notes(body text)')\n"
    "db.execute(\"insert into notes values ('warmed up in the template')\")\n"
    "counter = 0"
)
# What each grandchild does from the branch: its name in the tree → Python it evaluates.
STRATEGIES = {
    "retry": "counter += 10; 'retried'",
    "rewrite": "db.execute('delete from notes'); counter = 0; 'rewrote'",
    "explore": "counter += 100; statistics.mean([1, 2, 3, 4])",
}


def run(ctl: Controller, children: int, memory_mib: int) -> None:
    tag = f"demo-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        started = time.monotonic()
        with console.status(f"building template {tag}: boot a {memory_mib} MiB VM, warm, snapshot"):
            template = Snapshot.create(
                tag,
                controller=ctl,
                memory_mib=memory_mib,
                setup=TEMPLATE_SETUP,
                warmup=TEMPLATE_WARMUP,
            )
        snaps.append(template)
        build_ms = (time.monotonic() - started) * 1000
        console.print(
            f"[bold]template[/] {tag}: booted, warmed (imports, sqlite, counter = 0) and "
            f"snapshotted in {ms(build_ms)}"
        )

        started = time.monotonic()
        with console.status(f"forking {children} children"):
            kids = template.fork(children)
        made += kids
        show_children(kids, (time.monotonic() - started) * 1000, build_ms)
        show_warm_forks(template)

        source = kids[0]
        source.eval("counter += 1; db.execute(\"insert into notes values ('child work')\")")
        source.files.write("/work/plan.txt", "step 1 done in the child\n")
        console.print(f"[bold]{source.id}[/] did some work: counter = 1, a row, /work/plan.txt")

        branch = source.branch()
        snaps.append(branch)
        console.print(
            f"[bold]branch[/] {branch.tag} of {source.id}: vCPUs frozen for "
            f"{ms(branch.pause_ms)}, then it kept running"
        )
        with console.status("forking 3 grandchildren from the branch"):
            grandkids = branch.fork(len(STRATEGIES))
        made += grandkids
        show_lineage(tag, kids, branch, grandkids)
    finally:
        cleanup(made, snaps, console)


def show_children(kids: list[Sandbox], wall_ms: float, build_ms: float) -> None:
    """A table of what each child sees: the template's state, its own randomness."""
    table = Table("child", "fork", "counter", "random.random()", "os.urandom(4)")
    for kid in kids:
        table.add_row(
            kid.id,
            ms(kid.info.get("fork_ms")),
            kid.eval("counter").result,
            kid.eval("import random; round(random.random(), 6)").result,
            kid.eval("import os; os.urandom(4).hex()").result,
        )
    console.print(table)
    median = sorted(k.info.get("fork_ms") or 0 for k in kids)[len(kids) // 2]
    console.print(
        f"  {len(kids)} children in {ms(wall_ms)} wall (forked concurrently); median fork "
        f"{ms(median)} vs {ms(build_ms)} to build the template. Same state, fresh randomness."
    )


WARM_ROUNDS = 3


def show_warm_forks(template: Snapshot) -> None:
    """What a fork costs at its best, beside the cold figure above: one at a time, once the
    template's memory is in the page cache (and the daemon's pool, if it keeps one,
    has QEMUs waiting). Each is killed before the next."""
    fork_ms, wall_ms = [], []
    with console.status(f"forking {WARM_ROUNDS} more, one at a time (warm)"):
        for _ in range(WARM_ROUNDS):
            started = time.monotonic()
            (kid,) = template.fork(1)
            wall_ms.append((time.monotonic() - started) * 1000)
            fork_ms.append(kid.info.get("fork_ms") or 0.0)
            kid.kill()
    console.print(
        f"  warm: {WARM_ROUNDS} more forks one at a time, the template's memory cached: "
        f"median fork {ms(sorted(fork_ms)[WARM_ROUNDS // 2])} (best {ms(min(fork_ms))}), "
        f"{ms(sorted(wall_ms)[WARM_ROUNDS // 2])} per request seen from here. The figures "
        "above are the cold case: the first forks of a fresh template, all at once."
    )


def show_lineage(tag: str, kids: list[Sandbox], branch: Snapshot, grandkids: list[Sandbox]) -> None:
    """Run one strategy in each grandchild and draw the tree: template, children, branch."""
    source = kids[0]
    tree = Tree(f"template [bold]{tag}[/]")
    node = tree.add(f"{source.id} → branch {branch.tag} (pause {ms(branch.pause_ms)})")
    for (name, code), g in zip(STRATEGIES.items(), grandkids, strict=True):
        outcome = g.eval(code).result
        rows = g.eval("db.execute('select count(*) from notes').fetchone()[0]").result
        node.add(
            escape(  # plain text: '[retry]' and a result's brackets are not markup
                f"{g.id} [{name}] fork {ms(g.info.get('fork_ms'))}: result={outcome} "
                f"counter={g.eval('counter').result} rows={rows} "
                f"plan={g.files.read_text('/work/plan.txt').strip()!r}"
            )
        )
    node.add(f"{source.id} itself, still running: counter={source.eval('counter').result}")
    for kid in kids[1:]:
        tree.add(f"{kid.id}: counter={kid.eval('counter').result}")
    console.print(tree)
    console.print(
        "Each grandchild started from the child's exact state at the branch and went its "
        "own way; the child, its siblings and the template are untouched."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args(argv)
    with daemon(args.url) as ctl:
        run(ctl, args.children, args.memory)


if __name__ == "__main__":
    main()
