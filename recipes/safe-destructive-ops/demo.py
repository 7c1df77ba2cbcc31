#!/usr/bin/env python3
"""Safe destructive operations: branch before ``rm -rf``, fork the branch if you regret it.

An agent often has to run a command whose effect it cannot fully predict: a
``rm -rf`` of a build directory, a migration, a ``git clean -fdx``, a
refactoring script that rewrites files in place. Undoing such a command in an
ordinary container means rebuilding the whole environment. Here the agent
branches its sandbox first (a pause of milliseconds; files and the warm
interpreter are both captured, since the sandbox's files live in guest RAM),
then runs the command. If the result is wrong, it forks the checkpoint and
carries on in a sandbox where the command never ran, throwing the broken one
away; if the result is right, it deletes the checkpoint and carries on where it is.

Run: ``python recipes/safe-destructive-ops/demo.py`` (uses the daemon at
``FORKD_URL``, or starts one for the duration of the demo).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import secrets
import sys

from rich.console import Console
from rich.table import Table

from forkd import Controller, ControllerError, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed

console = Console(highlight=False)

ROOT = "/work/project"
# The project tree the agent works on: path under ROOT -> exact bytes.
PROJECT: dict[str, bytes] = {
    "README.md": b"# tiny project\n\nA project the agent must not lose.\n",
    "src/app.py": b"from util import greet\n\nprint(greet('forkd'))\n",
    "src/util.py": b"def greet(name):\n    return f'hello, {name}'\n",
    "tests/test_util.py": b"from util import greet\n\nassert greet('x') == 'hello, x'\n",
    "data/config.json": b'{"retries": 3, "verbose": false}\n',
    "data/blob.bin": bytes(range(256)) * 4 + os.urandom(1024),  # binary, partly random
}
# Build artefacts for the "confirm" scenario: meant to be deleted.
BUILD = {f"build/obj/{i:03d}.o": f"object {i}\n".encode() for i in range(40)}
APP_OUTPUT = "hello, forkd"

# Defined in the template's warm interpreter, so every fork and branch has it.
WARMUP = """\
import hashlib, os

def manifest(root):
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, 'rb') as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out
"""


def sha256_manifest(files: dict[str, bytes]) -> dict[str, str]:
    return {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}


def guest_manifest(sb: Sandbox) -> dict[str, str] | None:
    res = sb.eval(f"manifest({ROOT!r})")
    if not res.ok or res.result is None:
        raise RuntimeError(f"manifest() failed in {sb.id}: {res.error}")
    return ast.literal_eval(res.result)


def write_tree(sb: Sandbox, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        sb.files.write(f"{ROOT}/{path}", data)


def byte_for_byte(sb: Sandbox, files: dict[str, bytes]) -> list[str]:
    """Paths whose contents in the sandbox differ from ``files``."""
    return [p for p, data in files.items() if sb.files.read(f"{ROOT}/{p}") != data]


def exists(sb: Sandbox, path: str) -> bool:
    return sb.commands.run(["test", "-e", path]).exit_code == 0


def run(ctl: Controller, memory_mib: int, check: Checks) -> None:
    prefix = f"sdo-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    timings = Table("step", "time", title="timings")
    expected = sha256_manifest(PROJECT)
    try:
        msg = f"building template {prefix}: boot a {memory_mib} MiB VM, snapshot"
        template, build_ms = create_template(
            ctl, prefix, console, msg, snaps, image="python", memory_mib=memory_mib, warmup=WARMUP
        )
        timings.add_row("template boot + warmup + snapshot", ms(build_ms))
        console.print(f"[bold]template[/] {prefix} ready in {ms(build_ms)}")

        # ---------------------------------------------------------------- regret
        console.rule("scenario 1: regret (the rm -rf was a mistake)")
        (work,), fork_ms = timed(lambda: template.fork(1))
        made.append(work)
        timings.add_row(f"fork {work.id} from the template", ms(fork_ms))
        write_tree(work, PROJECT)
        console.print(f"[bold]{work.id}[/]: wrote {len(PROJECT)} files under {ROOT}")
        check("project tree written", guest_manifest(work) == expected)

        checkpoint, branch_ms = timed(lambda: work.branch(tag=f"{prefix}-regret"))
        snaps.append(checkpoint)
        timings.add_row("branch (checkpoint) wall", ms(branch_ms))
        timings.add_row("branch pause (source frozen)", ms(checkpoint.pause_ms))
        console.print(
            f"[bold]checkpoint[/] {checkpoint.tag}: {work.id} frozen for "
            f"{ms(checkpoint.pause_ms)} ({ms(branch_ms)} wall), then it kept running"
        )

        rm, rm_ms = timed(lambda: work.commands.run(f"rm -rf {ROOT}"))
        timings.add_row("rm -rf /work/project", ms(rm_ms))
        console.print(f"[bold]{work.id}[/]: ran [red]rm -rf {ROOT}[/] (exit {rm.exit_code})")
        check("rm -rf ran", rm.ok, rm.stderr)
        check("the source is broken: the project is gone", not exists(work, ROOT))
        broken = work.commands.run(f"python3 {ROOT}/src/app.py")
        check("the source is broken: app.py no longer runs", not broken.ok)

        (restored,), restore_ms = timed(lambda: checkpoint.fork(1))
        made.append(restored)
        timings.add_row("fork the checkpoint (restore)", ms(restore_ms))
        console.print(
            f"[bold]{restored.id}[/]: forked from {checkpoint.tag} in {ms(restore_ms)} "
            f"(fork_ms {ms(restored.info.get('fork_ms'))})"
        )
        got = guest_manifest(restored)
        check(
            "restored tree has exactly the checkpointed files (sha256 of each)",
            got == expected,
            f"got {sorted(got or {})}",
        )
        bad = byte_for_byte(restored, PROJECT)
        check("restored files match byte-for-byte", not bad, f"differ: {bad}")

        work.kill()
        try:
            ctl.get_sandbox(work.id)
            gone = False
        except ControllerError as exc:
            gone = exc.status == 404
        check(f"broken source {work.id} killed", gone)

        restored.files.write(f"{ROOT}/NOTES.md", "kept working after the restore\n")
        res = restored.commands.run(f"python3 {ROOT}/src/app.py")
        check(
            "work continues in the restored fork (app.py runs, new file written)",
            res.ok and res.stdout.strip() == APP_OUTPUT and exists(restored, f"{ROOT}/NOTES.md"),
            f"exit {res.exit_code}: {res.stdout!r} {res.stderr!r}",
        )

        # --------------------------------------------------------------- confirm
        console.rule("scenario 2: confirm (the destructive change was intended)")
        (second,), fork2_ms = timed(lambda: template.fork(1))
        made.append(second)
        timings.add_row(f"fork {second.id} from the template", ms(fork2_ms))
        write_tree(second, {**PROJECT, **BUILD})
        console.print(
            f"[bold]{second.id}[/]: wrote {len(PROJECT)} project files and "
            f"{len(BUILD)} build artefacts"
        )
        check(
            "project + build tree written",
            guest_manifest(second) == sha256_manifest({**PROJECT, **BUILD}),
        )

        safety, branch2_ms = timed(lambda: second.branch(tag=f"{prefix}-confirm"))
        snaps.append(safety)
        timings.add_row("branch (checkpoint 2) wall", ms(branch2_ms))
        timings.add_row("branch 2 pause (source frozen)", ms(safety.pause_ms))
        console.print(f"[bold]checkpoint[/] {safety.tag}: pause {ms(safety.pause_ms)}")

        clean = second.commands.run(f"rm -rf {ROOT}/build && rm -f {ROOT}/data/blob.bin")
        console.print(
            f"[bold]{second.id}[/]: ran [red]rm -rf {ROOT}/build && rm -f {ROOT}/data/blob.bin[/]"
        )
        check("intended change ran", clean.ok, clean.stderr)
        kept = {p: d for p, d in PROJECT.items() if p != "data/blob.bin"}
        check(
            "intended change verified: build/ and blob.bin gone, the rest intact",
            guest_manifest(second) == sha256_manifest(kept) and not byte_for_byte(second, kept),
        )

        _, delete_ms = timed(safety.delete)
        snaps.remove(safety)
        timings.add_row("delete checkpoint 2", ms(delete_ms))
        tags = {s["tag"] for s in ctl.list_snapshots()}
        check(f"checkpoint {safety.tag} deleted", safety.tag not in tags)

        res = second.commands.run(
            "python3 app.py && PYTHONPATH=. python3 ../tests/test_util.py && echo tests-ok",
            cwd=f"{ROOT}/src",
        )
        check(
            "work continues in the source after the delete",
            res.ok and res.stdout.split() == [*APP_OUTPUT.split(), "tests-ok"],
            f"exit {res.exit_code}: {res.stdout!r} {res.stderr!r}",
        )
        console.print(timings)
    finally:
        cleanup(made, snaps, console, report=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args()
    return run_checks(args.url, console, lambda ctl, check: run(ctl, args.memory, check))


if __name__ == "__main__":
    sys.exit(main())
