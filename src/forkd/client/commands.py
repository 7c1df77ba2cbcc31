"""``sandbox.commands``: run programs in a sandbox, waiting for them or in the background.

The shape is E2B's: ``run(cmd, on_stdout=..., background=True)`` returns a
:class:`CommandHandle` with ``pid``, ``wait()``, ``kill()``, ``send_stdin()``
and iteration over the output; ``list()`` and ``connect(pid)`` find
processes again, from another client or in a fork of the sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Literal, overload

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.results import CommandResult, OutputEvent, exit_code_of

if TYPE_CHECKING:
    from forkd.client.controller import Controller
    from forkd.client.sandbox import Sandbox

FOREGROUND_TIMEOUT_SECS = 30.0
OutputCallback = Callable[[str], object]
Stdin = str | bytes | bool | None


class HandleOutput:
    """What a handle has read of a process's output so far: where reading resumes,
    stdout and stderr, the exit code; shared by the sync and the async handle."""

    def __init__(self, sandbox_id: str, pid: int, offset: int = 0) -> None:
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.offset = offset  # where reading resumes
        self.exit_code: int | None = None
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._on_stdout: OutputCallback | None = None
        self._on_stderr: OutputCallback | None = None

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def _take(self, event: OutputEvent) -> None:
        """Account for one event of the stream (and call the output callbacks)."""
        if event.next_offset is not None:
            self.offset = event.next_offset
        if event.kind == "stdout":
            self._stdout.append(event.text)
            if self._on_stdout is not None:
                self._on_stdout(event.text)
        elif event.kind == "stderr":
            self._stderr.append(event.text)
            if self._on_stderr is not None:
                self._on_stderr(event.text)
        elif event.kind == "exit":
            self.exit_code = event.exit_code

    def _result(self) -> CommandResult:
        raw = {"pid": self.pid, "exit_code": self.exit_code}
        return CommandResult(self.stdout, self.stderr, exit_code_of(raw), raw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sandbox={self.sandbox_id!r}, pid={self.pid})"


class CommandHandle(HandleOutput):
    """A process running in a sandbox, its output read as it comes.

    Output is read from where the handle left off, each event once: iterate
    over the handle, or call :meth:`wait`; ``stdout`` and ``stderr`` hold what
    was read so far. A broken connection raises ControllerError; reading
    again resumes without loss while the output is in the guest's 4 MiB ring.

    Example::

        h = sb.commands.run("python3 -u -m http.server 8000", background=True)
        for stdout, stderr, _pty in h:
            if stdout and "Serving" in stdout:
                break
        h.kill()
    """

    def __init__(self, controller: Controller, sandbox_id: str, pid: int, offset: int = 0) -> None:
        super().__init__(sandbox_id, pid, offset)
        self._controller = controller

    def events(self) -> Iterator[OutputEvent]:
        """The output's events from :attr:`offset` until it exits (``exit`` last)."""
        if self.exit_code is not None:
            return
        for event in self._controller.process_output(self.sandbox_id, self.pid, self.offset):
            self._take(event)
            yield event

    def __iter__(self) -> Iterator[tuple[str | None, str | None, bytes | None]]:
        """``(stdout, stderr, pty)`` for each piece of output, one of them set."""
        for event in self.events():
            if event.kind == "stdout":
                yield event.text, None, None
            elif event.kind == "stderr":
                yield None, event.text, None
            elif event.kind == "pty":
                yield None, None, event.data

    def wait(
        self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> CommandResult:
        """Read the output until the process exits; what it printed and its exit code.

        A non-zero exit is not an exception: check ``result.exit_code``.
        """
        self._on_stdout = on_stdout or self._on_stdout
        self._on_stderr = on_stderr or self._on_stderr
        for _ in self.events():
            pass
        return self._result()

    def send_stdin(self, data: str | bytes) -> None:
        """Write to its stdin (started with ``stdin=True``, or in a terminal)."""
        self._controller.send_stdin(self.sandbox_id, self.pid, data)

    def close_stdin(self) -> None:
        """End its input: it reads EOF."""
        self._controller.send_stdin(self.sandbox_id, self.pid, b"", eof=True)

    def signal(self, signal: int | str = "SIGTERM") -> None:
        self._controller.signal_process(self.sandbox_id, self.pid, signal)

    def kill(self) -> bool:
        """SIGKILL its process group; False when no such process is known."""
        try:
            self.signal("SIGKILL")
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def info(self) -> JSONDict:
        """Its ProcessInfo now: ``running``, ``exit_code``, ``output_end``, ..."""
        return self._controller.get_process(self.sandbox_id, self.pid)


class Commands:
    """``sandbox.commands``: run programs in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    @overload
    def run(
        self,
        cmd: str | list[str],
        timeout: float | None = ...,
        cwd: str | None = ...,
        env: dict[str, str] | None = ...,
        stdin: Stdin = ...,
        *,
        background: Literal[False] = ...,
        on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ...,
        envs: dict[str, str] | None = ...,
        user: str | None = ...,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str | list[str],
        timeout: float | None = ...,
        cwd: str | None = ...,
        env: dict[str, str] | None = ...,
        stdin: Stdin = ...,
        *,
        background: Literal[True],
        on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ...,
        envs: dict[str, str] | None = ...,
        user: str | None = ...,
    ) -> CommandHandle: ...

    def run(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: Stdin = None,
        *,
        background: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
    ) -> CommandResult | CommandHandle:
        """Run ``cmd`` (a str runs as ``/bin/sh -c cmd``) and wait for it, or not.

        ``timeout``: seconds until it is killed (exit code 124); by default 30
        in the foreground and none in the background. ``stdin``: data to feed
        it, then EOF; ``True`` (background only) keeps it open for ``send_stdin``. ``envs``
        (E2B's name) and ``env`` are merged over the sandbox's environment. ``user``:
        run as this user (a name, uid, ``name:group`` or ``uid:gid``); by default the
        image's USER, else root.

        With ``on_stdout``/``on_stderr``, each piece of output is passed to
        them as it arrives; ``background=True`` returns a
        :class:`CommandHandle` at once. A non-zero exit is not an exception.

        Example::

            r = sb.commands.run("for i in 1 2 3; do echo $i; sleep 1; done", on_stdout=print)
            h = sb.commands.run("npm run dev", background=True, cwd="/app")
            sb.commands.run("id -un", user="postgres").stdout      # 'postgres\n'
        """
        if stdin is True and not background:
            raise ValueError("stdin=True keeps stdin open for send_stdin: it needs background=True")
        merged_env = {**(env or {}), **(envs or {})} or None
        streamed = background or on_stdout is not None or on_stderr is not None
        if not streamed:
            piped = None if isinstance(stdin, bool) else stdin or None  # True raised above
            return self._exec(cmd, timeout, cwd, merged_env, piped, user)
        if timeout is None and not background:
            timeout = FOREGROUND_TIMEOUT_SECS
        sb = self._sandbox
        info = sb.controller.start_process(
            sb.id,
            cmd,
            env=merged_env,
            cwd=cwd,
            stdin=stdin not in (None, False),
            timeout_s=timeout or None,
            user=user,
        )
        handle = CommandHandle(sb.controller, sb.id, int(info["pid"]))
        if isinstance(stdin, str | bytes):
            sb.controller.send_stdin(sb.id, handle.pid, stdin, eof=True)
        if background:
            handle._on_stdout, handle._on_stderr = on_stdout, on_stderr
            return handle
        return handle.wait(on_stdout, on_stderr)

    def _exec(
        self,
        cmd: str | list[str],
        timeout: float | None,
        cwd: str | None,
        env: dict[str, str] | None,
        stdin: str | bytes | None,
        user: str | None,
    ) -> CommandResult:
        """Through ``/exec``: one request, the output whole when the command ends."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        sb = self._sandbox
        raw = sb.controller.exec_command(
            sb.id,
            args,
            timeout_secs=timeout or FOREGROUND_TIMEOUT_SECS,
            cwd=cwd,
            env=env,
            stdin=stdin,
            user=user,
        )
        return CommandResult.from_answer(raw)

    def list(self) -> list[JSONDict]:
        """The sandbox's processes: running ones, then recently exited ones (ProcessInfo)."""
        return self._sandbox.controller.list_processes(self._sandbox.id)

    def connect(self, pid: int, offset: int = 0) -> CommandHandle:
        """A handle on process ``pid``, reading its output from ``offset``.

        In a fork or a branch of the sandbox, the processes that ran in the
        parent run on, with their output so far: connect to them by pid.
        """
        sb = self._sandbox
        sb.controller.get_process(sb.id, pid)  # a 404 now, not at the first read
        return CommandHandle(sb.controller, sb.id, pid, offset)

    def kill(self, pid: int) -> bool:
        """SIGKILL process ``pid``; False when no such process is known."""
        return CommandHandle(self._sandbox.controller, self._sandbox.id, pid).kill()

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        self._sandbox.controller.send_stdin(self._sandbox.id, pid, data)
