"""The ``eval`` command: Python in a sandbox's warm interpreter, its output and displays."""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from forkd.cli import render
from forkd.cli.failures import daemon_errors, fail
from forkd.cli.options import Connection
from forkd.cli.processes import ChildOpt, MaybeSandboxIdArg, target_and_argv
from forkd.cli.render import err

if TYPE_CHECKING:
    from forkd.client import Controller

SandboxIdArg = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")]
FILE_SUFFIXES = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/svg+xml": ".svg",
    "text/html": ".html",
    "text/markdown": ".md",
}
ANSWER_POLL_SECS = 0.2  # how often the wait for the answer lets Ctrl-C through


CodeArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="CODE", help="Python; the repr of a final expression prints (words joined)."
    ),
]
EvalTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        "--timeout-secs",
        min=0.001,
        help="Interrupt the code after this many seconds (default: the daemon's, 60).",
    ),
]
DisplayDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--display-dir",
        help="Save images and other rich display outputs here "
        "(display-1.png, ...); without it, each prints as one line.",
    ),
]


def eval_(
    conn: Connection,
    sandbox_id: MaybeSandboxIdArg = None,
    code: CodeArg = None,
    timeout: EvalTimeoutOpt = None,
    display_dir: DisplayDirOpt = None,
    child: ChildOpt = None,
) -> None:
    """Evaluate Python in a sandbox's persistent interpreter.

    Ctrl-C interrupts the code (KeyboardInterrupt) and prints its traceback;
    a second Ctrl-C stops waiting.
    """
    sandbox_id, words = target_and_argv(sandbox_id, code, child)
    if not words:
        raise typer.BadParameter(f"no code: forkd eval {sandbox_id} 'CODE'")
    with daemon_errors(), conn.controller() as ctl:
        result = _eval_interruptibly(ctl, sandbox_id, " ".join(words), timeout)
    failed = result.get("error") is not None or int(result.get("exit_code") or 0) != 0
    if conn.as_json:
        render.print_json(result)
        raise typer.Exit(1 if failed else 0)
    _print_result(result, display_dir, failed)


def _print_result(result: dict[str, Any], display_dir: Path | None, failed: bool) -> None:
    """The eval's output, displays and error (then exit 1), or its result's repr."""
    if result.get("stdout"):
        sys.stdout.write(result["stdout"])
    if result.get("stderr"):
        sys.stderr.write(result["stderr"])
    _print_displays(result.get("display") or [], display_dir)
    if failed:
        sys.stdout.flush()
        error = (
            result.get("traceback") or result.get("error") or f"exit code {result.get('exit_code')}"
        )
        sys.stderr.write(str(error).rstrip("\n") + "\n")
        sys.stderr.flush()
        raise typer.Exit(1)
    if result.get("result") is not None:
        sys.stdout.write(str(result["result"]) + "\n")
    sys.stdout.flush()


def _eval_interruptibly(
    ctl: Controller, sandbox_id: str, code: str, timeout: float | None
) -> dict[str, Any]:
    """The eval's answer; the first Ctrl-C interrupts the eval in the sandbox, a
    second stops waiting.

    Ctrl-C is counted by a SIGINT handler, not caught as KeyboardInterrupt: that
    can be raised between any two statements, outside the ``try`` meant for it.
    """
    answers: queue.SimpleQueue[tuple[dict[str, Any] | None, BaseException | None]]
    answers = queue.SimpleQueue()

    def ask() -> None:
        try:
            answers.put((ctl.eval_code(sandbox_id, code, timeout), None))
        except BaseException as exc:  # raised again on the main thread
            answers.put((None, exc))

    # A daemon thread: a second Ctrl-C leaves without waiting for it.
    threading.Thread(target=ask, name="eval", daemon=True).start()
    with _ctrl_c_counted() as presses:
        handled = 0
        while True:
            if presses[0] > handled:
                if handled:
                    raise fail("stopped waiting; the eval may still run", 130)
                handled = 1
                if not ctl.interrupt_eval(sandbox_id)["interrupted"]:
                    err.print("no eval was running to interrupt")
                continue
            try:
                answer, problem = answers.get(timeout=ANSWER_POLL_SECS)
            except queue.Empty:
                continue
            if problem is not None:
                raise problem
            assert answer is not None
            return answer


@contextlib.contextmanager
def _ctrl_c_counted() -> Iterator[list[int]]:
    """``[n]``: how many times Ctrl-C (SIGINT) was pressed inside the block. Off the
    main thread, where no handler can be set, Ctrl-C stays KeyboardInterrupt."""
    presses = [0]

    def count(signum: int, frame: object) -> None:
        presses[0] += 1

    if threading.current_thread() is not threading.main_thread():
        yield presses
        return
    previous = signal.signal(signal.SIGINT, count)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)


def _print_displays(displays: list[dict[str, str]], display_dir: Path | None) -> None:
    """Text outputs as they are; the others saved to ``display_dir`` or named in one line."""
    for number, item in enumerate(displays, 1):
        mime, data = item.get("mime", ""), item.get("data", "")
        if mime == "text/plain":
            sys.stdout.write(data.rstrip("\n") + "\n")
            continue
        from forkd.client.results import DisplayOutput

        content = DisplayOutput(mime, data).content
        if display_dir is None:
            sys.stdout.write(f"[{mime}, {len(content)} bytes: --display-dir saves it]\n")
            continue
        display_dir.mkdir(parents=True, exist_ok=True)
        path = display_dir / f"display-{number}{FILE_SUFFIXES.get(mime, '.bin')}"
        path.write_bytes(content)
        sys.stdout.write(f"[{mime} saved to {path}]\n")
