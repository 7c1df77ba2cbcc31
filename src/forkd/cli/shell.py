"""Interactive sessions: ``forkd shell ID`` and ``forkd exec -i/-t``, a local terminal
joined to a process in a sandbox.

With ``-t`` the process runs in a terminal in the guest and its bytes go over
the terminal WebSocket (``sb.pty``): the local terminal is put in raw mode,
so every key, Ctrl-C included, goes to the guest; SIGWINCH resizes the
remote terminal; the local terminal is restored on every way out. With
``-i`` alone the process reads our stdin through a pipe, EOF included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import termios
import threading
import tty
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err

if TYPE_CHECKING:
    import httpx

    from forkd.client import Controller
    from forkd.client.pty import PtyHandle

SandboxIdArg = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")]
DEFAULT_SIZE = (80, 24)  # columns, rows: when our stdout is not a terminal
EOF_KEY = b"\x04"  # Ctrl-D: what a terminal sends for the end of piped input
POLL_SECS = 0.2  # how soon a SIGWINCH is passed on while no output comes


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``forkd shell`` to ``app``; ``transport`` is for tests."""
    app.command("shell")(with_connection(shell, transport=transport, json_option=False))


def shell(
    conn: Connection,
    sandbox_id: SandboxIdArg,
    cwd: Annotated[str | None, typer.Option("--cwd", help="Working directory.")] = None,
    env: Annotated[
        list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")
    ] = None,
) -> None:
    """Open an interactive login shell in a sandbox (bash where the image has it);
    exits with the shell's exit code. Ctrl-C goes to the shell; leave with exit or Ctrl-D."""
    from forkd.cli.processes import parse_env
    from forkd.client.pty import LOGIN_SHELL

    env_map = parse_env(env) if env else None
    code = run_in_terminal(conn, sandbox_id, LOGIN_SHELL, cwd=cwd, env=env_map, keys=True)
    raise typer.Exit(code)


def terminal_size() -> tuple[int, int]:
    """Our terminal's (columns, rows), or :data:`DEFAULT_SIZE` when stdout is not one."""
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, ValueError):
        return DEFAULT_SIZE
    return (max(size.columns, 1), max(size.lines, 1))


def _with_term(env: dict[str, str] | None) -> dict[str, str] | None:
    """``env`` with our ``TERM``, so programs in the guest draw for this terminal."""
    term = os.environ.get("TERM")
    return {"TERM": term, **(env or {})} if term else env


def run_in_terminal(
    conn: Connection,
    sandbox_id: str,
    cmd: list[str],
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    keys: bool = True,
) -> int:
    """Start ``cmd`` in a terminal in the sandbox, join it to ours until it exits;
    its exit code (0-255; 1 when it has none). ``keys``: pass our stdin on."""
    stdin_fd = sys.stdin.fileno()
    local_tty = keys and os.isatty(stdin_fd)
    if keys and not local_tty:
        err.print(
            "[yellow]stdin is not a terminal: its bytes are typed as they come, then Ctrl-D[/]"
        )
    # Raw before the process starts: a Ctrl-C typed while it starts is a key for
    # the guest, not a SIGINT here (the terminal is restored before any error shows).
    with daemon_errors(), conn.controller() as ctl, _raw_mode(stdin_fd if local_tty else None):
        from forkd.client.pty import PtyHandle

        info = ctl.start_process(
            sandbox_id, cmd, env=_with_term(env), cwd=cwd, pty=terminal_size(), timeout_s=timeout
        )
        with PtyHandle(ctl, sandbox_id, int(info["pid"])) as term:
            code = _join(term, keys, stdin_fd)
    return code if code is not None and 0 <= code <= 255 else 1


def _join(term: PtyHandle, keys: bool, stdin_fd: int) -> int | None:
    """Copy the terminal to our stdout, and our stdin to it, until the process exits
    (our terminal is already raw)."""
    resized = threading.Event()
    out_fd = sys.stdout.fileno()
    with _on_sigwinch(resized.set):
        if keys:
            threading.Thread(target=_type_keys, args=(term, stdin_fd), daemon=True).start()
        while True:
            data = term.read(timeout=POLL_SECS)
            if data is None:
                return term.exit_code
            if data:
                _write_all(out_fd, data)
            if resized.is_set():
                resized.clear()
                term.resize(*terminal_size())


def _type_keys(term: PtyHandle, stdin_fd: int) -> None:
    """Our stdin to the terminal, as it comes; at its end, Ctrl-D."""
    from forkd.client import ControllerError

    with contextlib.suppress(ControllerError, OSError):  # the session ended first
        while data := os.read(stdin_fd, 4096):
            term.send_stdin(data)
        term.send_stdin(EOF_KEY)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextlib.contextmanager
def _raw_mode(fd: int | None) -> Iterator[None]:
    """Terminal ``fd`` in raw mode for the block (nothing when None), restored however it ends."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    # TCSADRAIN, not setraw's default TCSAFLUSH: keys typed ahead (before the
    # session was up) are kept and go to the guest, not discarded.
    tty.setraw(fd, termios.TCSADRAIN)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _on_sigwinch(handler: Callable[[], object]) -> Iterator[None]:
    """``handler()`` on each SIGWINCH during the block; the old handler after it."""
    previous = signal.signal(signal.SIGWINCH, lambda _sig, _frame: handler())
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


def pipe_stdin(ctl: Controller, sandbox_id: str, pid: int) -> threading.Thread:
    """A thread that copies our stdin to process ``pid``'s (``exec -i``), then closes it."""
    from forkd.client import ControllerError

    def copy() -> None:
        with contextlib.suppress(ControllerError, OSError):  # the process ended first
            while data := os.read(sys.stdin.fileno(), 64 << 10):
                ctl.send_stdin(sandbox_id, pid, data)
            ctl.send_stdin(sandbox_id, pid, b"", eof=True)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread
