"""The commands on a sandbox's processes: ``exec`` (output as it comes), ``top``, ``kill``."""

from __future__ import annotations

import functools
import re
import sys
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from forkd.cli import render
from forkd.cli.failures import act_on_each, daemon_errors, fail
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import err, out, shown

if TYPE_CHECKING:
    import httpx

    from forkd.client import Controller

SandboxIdArg = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.")]
# exec's and eval's sandbox: ``ID``, or the original forkd's ``--child ID`` (target_and_argv).
MaybeSandboxIdArg = Annotated[str | None, typer.Argument(metavar="ID", help="Sandbox id.")]
ChildOpt = Annotated[
    str | None,
    typer.Option("--child", "--target", help="The sandbox, named as the original forkd did."),
]
CommandArg = Annotated[
    list[str] | None, typer.Argument(metavar="-- CMD...", help="Program and its arguments.")
]
ExecTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        "--timeout-secs",
        help="Kill the command after this many seconds [default: 30; none with -i or -t]",
        show_default=False,
    ),
]
CwdOpt = Annotated[str | None, typer.Option("--cwd", help="Working directory.")]
ExecEnvOpt = Annotated[
    list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")
]
InteractiveOpt = Annotated[
    bool, typer.Option("--interactive", "-i", help="Pass our stdin to the command.")
]
TtyOpt = Annotated[
    bool, typer.Option("--tty", "-t", help="Run it in a terminal joined to ours (raw mode).")
]
ShOpt = Annotated[str | None, typer.Option("--sh", help="Run this shell line (as -- sh -c LINE).")]
STREAM_RETRIES = 3  # a broken output stream is resumed at its offset this many times


# In a command's one argument: what a shell would have read (a user wrote a shell line).
SHELL_SYNTAX = re.compile(r"[\s|&;<>$`*?(){}]")


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add the process commands to ``app``; ``transport`` is for tests."""
    daemon = functools.partial(with_connection, transport=transport)
    app.command("exec")(daemon(exec_))
    app.command("kill")(daemon(kill))


def exec_(
    conn: Connection,
    sandbox_id: MaybeSandboxIdArg = None,
    cmd: CommandArg = None,
    timeout: ExecTimeoutOpt = None,
    cwd: CwdOpt = None,
    env: ExecEnvOpt = None,
    interactive: InteractiveOpt = False,
    tty: TtyOpt = False,
    sh: ShOpt = None,
    child: ChildOpt = None,
) -> None:
    """Run a command in a sandbox, printing its output as it comes; exits with its
    exit code (124: timed out). With --json, prints the whole result at the end.
    -it runs it in an interactive terminal, as forkd shell does."""
    sandbox_id, cmd = target_and_argv(sandbox_id, cmd, child)
    if sh is not None:
        if cmd:
            raise typer.BadParameter("--sh LINE or -- CMD..., not both")
        cmd = ["/bin/sh", "-c", sh]
    if not cmd:
        raise typer.BadParameter(f"no command: forkd exec {sandbox_id} -- CMD... or --sh 'LINE'")
    env_map = parse_env(env) if env else None
    if len(cmd) == 1 and SHELL_SYNTAX.search(cmd[0]):
        _note_one_program(sandbox_id, cmd[0])
    if interactive or tty:
        code = _exec_joined(conn, sandbox_id, list(cmd), cwd, env_map, timeout, tty, interactive)
        raise typer.Exit(code)
    timeout = 30 if timeout is None else timeout
    with daemon_errors(), conn.controller() as ctl:
        if conn.as_json:
            from forkd.client import exit_code_of

            result = ctl.exec_command(
                sandbox_id, list(cmd), timeout_secs=timeout, cwd=cwd, env=env_map
            )
            render.print_json(result)
            code = exit_code_of(result)
        else:
            info = ctl.start_process(sandbox_id, list(cmd), env=env_map, cwd=cwd, timeout_s=timeout)
            code = _follow(ctl, sandbox_id, int(info["pid"]))
    raise typer.Exit(code if 0 <= code <= 255 else 1)


def _note_one_program(sandbox_id: str, word: str) -> None:
    """A command of one word that reads as a shell line: say how to run it as one."""
    hint = f"forkd exec {sandbox_id} --sh {word!r} (or -- sh -c {word!r})"
    err.print(
        shown(
            f"note: {word!r} is run as one program's name, not by a shell; "
            f"for a shell command: {hint}"
        )
    )


def _exec_joined(
    conn: Connection,
    sandbox_id: str,
    cmd: list[str],
    cwd: str | None,
    env: dict[str, str] | None,
    timeout: float | None,
    tty: bool,
    interactive: bool,
) -> int:
    """``exec -t`` (in a terminal joined to ours; with -i, our keys go to it) or ``exec
    -i`` (our stdin piped to it): its exit code."""
    if conn.as_json:
        raise fail("--json prints one result at the end: it cannot go with -i or -t", 2)
    from forkd.cli import shell

    if tty:
        return shell.run_in_terminal(
            conn, sandbox_id, cmd, cwd=cwd, env=env, timeout=timeout, keys=interactive
        )
    return _exec_piped(conn, sandbox_id, cmd, cwd, env, timeout)


def _exec_piped(
    conn: Connection,
    sandbox_id: str,
    cmd: list[str],
    cwd: str | None,
    env: dict[str, str] | None,
    timeout: float | None,
) -> int:
    """``exec -i``: the command reads our stdin (EOF included) and prints as it goes."""
    from forkd.cli.shell import pipe_stdin

    with daemon_errors(), conn.controller() as ctl:
        info = ctl.start_process(sandbox_id, cmd, env=env, cwd=cwd, stdin=True, timeout_s=timeout)
        pipe_stdin(ctl, sandbox_id, int(info["pid"]))
        code = _follow(ctl, sandbox_id, int(info["pid"]))
    return code if 0 <= code <= 255 else 1


def _follow(ctl: Controller, sandbox_id: str, pid: int) -> int:
    """Copy the process's output to ours until it exits; its exit code.

    Ctrl-C sends it SIGINT, as a terminal would, and exits 130.
    """
    from forkd.client import ControllerError

    sinks: dict[str, BinaryIO] = {
        "stdout": sys.stdout.buffer,
        "stderr": sys.stderr.buffer,
        "pty": sys.stdout.buffer,
    }
    offset, retries = 0, STREAM_RETRIES
    try:
        while True:
            try:
                for event in ctl.process_output(sandbox_id, pid, offset):
                    if event.kind in sinks:
                        sinks[event.kind].write(event.data)
                        sinks[event.kind].flush()
                    elif event.kind == "gap":
                        end = event.next_offset
                        lost = "some" if end is None else end - (event.offset or 0)
                        err.print(f"[yellow]({lost} bytes of output were lost)[/]")
                    elif event.kind == "exit":
                        return -1 if event.exit_code is None else event.exit_code
                    offset = event.next_offset if event.next_offset is not None else offset
                raise ControllerError(0, "the output stream ended before the process did")
            except ControllerError as exc:
                if exc.status != 0 or retries == 0:
                    raise
                retries -= 1
    except KeyboardInterrupt:
        ctl.signal_process(sandbox_id, pid, "SIGINT")
        raise typer.Exit(130) from None


def parse_env(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items → a dict; exit 2 on one without ``=`` or a key."""
    env_map = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--env wants KEY=VALUE, not {shown(item)!r}", 2)
        env_map[key] = value
    return env_map


def show_processes(conn: Connection, sandbox_id: str) -> None:
    """List a sandbox's processes: running ones, then recently exited ones (``forkd top
    ID``; forkd.cli.usage has the command)."""
    with daemon_errors(), conn.controller() as ctl:
        procs = ctl.list_processes(sandbox_id)
    if conn.as_json:
        render.print_json(procs)
        return
    out.print(process_table(procs))
    if not procs:
        err.print(f"no processes in {shown(sandbox_id)}: start one with 'forkd exec'")


def process_table(procs: list[dict[str, Any]]) -> Any:
    table = render.wrapping_table("PID", "STATE", "STARTED", "OUTPUT", "COMMAND")
    for p in procs:
        state = "running" if p.get("running") else f"exited {p.get('exit_code')}"
        table.add_row(
            render.cell(p.get("pid")),
            state,
            render.age(p.get("started_at")),
            render.byte_size(p.get("output_end")),
            render.cell(" ".join(map(str, p.get("cmd") or []))),
        )
    return table


def kill(
    conn: Connection,
    targets: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="ID... | ID PID",
            help="Sandboxes to kill; or a sandbox and a process id in it, to signal.",
        ),
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Kill every sandbox.")] = False,
    tag: Annotated[
        str | None, typer.Option("--tag", help="Kill every sandbox forked from this snapshot.")
    ] = None,
    signal: Annotated[
        str | None,
        typer.Option(
            "--signal",
            "-s",
            help="With ID PID: the signal (TERM, KILL, 9...).",
            show_default="TERM",
        ),
    ] = None,
) -> None:
    """Kill sandboxes (IDs, --all, or --tag T: those forked from snapshot T); with a sandbox
    and a process id (ID PID), send that process (and its group) a signal instead."""
    ids = targets or []
    if every and tag is not None:
        raise typer.BadParameter("--all or --tag, not both")
    if len(ids) == 2 and ids[1].isdigit() and not every and tag is None:
        _signal(conn, ids[0], int(ids[1]), signal or "TERM")
        return
    if signal is not None:
        raise typer.BadParameter("--signal goes with a sandbox and a process id: kill ID PID")
    with daemon_errors(), conn.controller() as ctl:
        if every or tag is not None:
            ids = [sb["id"] for sb in ctl.list_sandboxes(snapshot=tag)]
            if not ids:
                err.print("no matching sandboxes")
                return
        elif not ids:
            raise fail("no sandbox named: pass ID..., --all or --tag TAG")
        act_on_each(ids, ctl.kill_sandbox, "killed", conn.as_json)


def _signal(conn: Connection, sandbox_id: str, pid: int, signal: str) -> None:
    sig: int | str = int(signal) if signal.isdigit() else signal
    with daemon_errors(), conn.controller() as ctl:
        ctl.signal_process(sandbox_id, pid, sig)
    if conn.as_json:
        render.print_json({"pid": pid, "signal": sig})
    else:
        out.print(f"sent {shown(str(sig))} to {pid} in {shown(sandbox_id)}")


def target_and_argv(
    sandbox_id: str | None, argv: list[str] | None, child: str | None
) -> tuple[str, list[str]]:
    """The sandbox and the command: ``ID -- CMD...``, or the original forkd's ``--child
    ID -- CMD...`` (then what reads as an ID is the command's first word)."""
    words = list(argv or [])
    if child is not None:
        if sandbox_id is not None:
            words.insert(0, sandbox_id)
        sandbox_id = child
    if sandbox_id is None:
        raise typer.BadParameter("name the sandbox: ID (or --child ID)")
    return sandbox_id, words
