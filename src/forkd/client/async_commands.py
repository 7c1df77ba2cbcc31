"""``sandbox.commands`` of an :class:`~forkd.client.AsyncSandbox`: programs run and
waited for, or started in the background as an :class:`AsyncCommandHandle` whose
output is read asynchronously (see :mod:`forkd.client.commands`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from forkd.client.async_controller import AsyncController
from forkd.client.commands import FOREGROUND_TIMEOUT_SECS, HandleOutput
from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.results import CommandResult, OutputEvent

if TYPE_CHECKING:
    from forkd.client.async_sandbox import AsyncSandbox


class AsyncCommandHandle(HandleOutput):
    """A process running in a sandbox (see ``CommandHandle``), read asynchronously."""

    def __init__(
        self, controller: AsyncController, sandbox_id: str, pid: int, offset: int = 0
    ) -> None:
        super().__init__(sandbox_id, pid, offset)
        self._controller = controller

    async def events(self) -> AsyncIterator[OutputEvent]:
        """The output's events from :attr:`offset` until it exits (``exit`` last)."""
        if self.exit_code is not None:
            return
        stream = self._controller.process_output(self.sandbox_id, self.pid, self.offset)
        async for event in stream:
            self._take(event)
            yield event

    async def wait(self) -> CommandResult:
        """Read the output until the process exits; what it printed and its exit code."""
        async for _ in self.events():
            pass
        return self._result()

    async def send_stdin(self, data: str | bytes) -> None:
        await self._controller.send_stdin(self.sandbox_id, self.pid, data)

    async def close_stdin(self) -> None:
        await self._controller.send_stdin(self.sandbox_id, self.pid, b"", eof=True)

    async def signal(self, signal: int | str = "SIGTERM") -> None:
        await self._controller.signal_process(self.sandbox_id, self.pid, signal)

    async def kill(self) -> bool:
        """SIGKILL its process group; False when no such process is known."""
        try:
            await self.signal("SIGKILL")
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def info(self) -> JSONDict:
        return await self._controller.get_process(self.sandbox_id, self.pid)


class AsyncCommands:
    """``sandbox.commands``: run programs in the sandbox and wait for them."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def run(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
        *,
        envs: dict[str, str] | None = None,
        user: str | None = None,
    ) -> CommandResult:
        """As :meth:`forkd.client.Commands.run` in the foreground: a str runs as
        ``/bin/sh -c cmd``; killed after ``timeout`` seconds (30) with exit code 124.
        ``user``: run as this user (default: the image's USER, else root)."""
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        sb = self._sandbox
        raw = await sb.controller.exec_command(
            sb.id,
            args,
            timeout_secs=timeout or FOREGROUND_TIMEOUT_SECS,
            cwd=cwd,
            env={**(env or {}), **(envs or {})} or None,
            stdin=stdin,
            user=user,
        )
        return CommandResult.from_answer(raw)

    async def start(
        self,
        cmd: str | list[str],
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        *,
        user: str | None = None,
    ) -> AsyncCommandHandle:
        """Start ``cmd`` in the background (``run(..., background=True)`` of the sync
        SDK); ``stdin=True`` keeps its stdin open for ``send_stdin``; ``user`` as
        :meth:`run`."""
        sb = self._sandbox
        info = await sb.controller.start_process(
            sb.id, cmd, env=env, cwd=cwd, stdin=stdin, timeout_s=timeout, user=user
        )
        return AsyncCommandHandle(sb.controller, sb.id, int(info["pid"]))

    async def connect(self, pid: int, offset: int = 0) -> AsyncCommandHandle:
        """A handle on process ``pid`` (a 404 now if there is none)."""
        sb = self._sandbox
        await sb.controller.get_process(sb.id, pid)
        return AsyncCommandHandle(sb.controller, sb.id, pid, offset)

    async def list(self) -> list[JSONDict]:
        """The sandbox's processes (ProcessInfo), running ones first."""
        return await self._sandbox.controller.list_processes(self._sandbox.id)
