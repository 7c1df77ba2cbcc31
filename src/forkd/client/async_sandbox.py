"""A sandbox as an asyncio object: :class:`AsyncSandbox` (its terminals: :class:`AsyncPty`).

It and :class:`~forkd.client.AsyncSnapshot` (:mod:`forkd.client.async_snapshot`)
mirror :class:`~forkd.client.Sandbox` and :class:`~forkd.client.Snapshot` method
for method, awaited, over an :class:`~forkd.client.AsyncController`; the answers
are the same result types (``CommandResult``, ``EvalResult``, SandboxInfo dicts);
a background command is an
:class:`~forkd.client.async_commands.AsyncCommandHandle`, a terminal an
``AsyncPtyHandle``, output and file contents async iterators. Its commands and
files are :mod:`forkd.client.async_commands`' and :mod:`forkd.client.async_files`'.

Example::

    async with AsyncController() as ctl:
        snap = await AsyncSnapshot.create("py", controller=ctl, warmup="x = 41")
        async with await AsyncSandbox.create("py", controller=ctl) as sb:
            print((await sb.commands.run("uname -r")).stdout)
            print((await sb.eval("x + 1")).result)                # '42'
            branch = await sb.branch()
            kids = await branch.fork(3)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Unpack

from forkd.client.async_commands import AsyncCommands
from forkd.client.async_controller import AsyncController
from forkd.client.async_files import AsyncFiles
from forkd.client.async_sockets import AsyncPtyHandle
from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.explore import DiffResult, ExploreOptions, ExploreResult, Step
from forkd.client.pty import LOGIN_SHELL, DataCallback
from forkd.client.results import EvalResult
from forkd.client.routes import KEEP
from forkd.client.views import SandboxView

if TYPE_CHECKING:
    from forkd.client.async_snapshot import AsyncSnapshot


class AsyncPty:
    """``sandbox.pty``: terminals in the sandbox (see ``Pty``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: str | list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        on_data: DataCallback | None = None,
        *,
        user: str | None = None,
    ) -> AsyncPtyHandle:
        """Start ``cmd`` (default: a login shell) in a ``cols`` x ``rows`` terminal,
        as ``user`` (default: the image's USER, else root)."""
        sb = self._sandbox
        info = await sb.controller.start_process(
            sb.id,
            LOGIN_SHELL if cmd is None else cmd,
            env=env,
            cwd=cwd,
            pty=(cols, rows),
            timeout_s=timeout,
            user=user,
        )
        return await AsyncPtyHandle(sb.controller, sb.id, int(info["pid"]), 0, on_data)._open()

    async def connect(
        self, pid: int, offset: int = 0, on_data: DataCallback | None = None
    ) -> AsyncPtyHandle:
        """The terminal of running process ``pid``, its output from ``offset``."""
        sb = self._sandbox
        return await AsyncPtyHandle(sb.controller, sb.id, pid, offset, on_data)._open()


class AsyncSandbox(SandboxView):
    """One running sandbox; ``await AsyncSandbox.create(tag)`` forks one,
    ``await AsyncSandbox.connect(id)`` attaches. ``async with`` kills it at the end."""

    def __init__(self, controller: AsyncController, info: JSONDict, *, owns: bool = False) -> None:
        self._controller = controller
        self._info = info
        self._owns_controller = owns
        self._killed = False
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)

    @classmethod
    async def create(
        cls, tag: str, *, controller: AsyncController | None = None, **spawn_kwargs: Any
    ) -> AsyncSandbox:
        """Fork a child of snapshot ``tag`` (keywords as ``spawn_sandboxes``). Without
        ``controller`` it makes its own from the environment and closes it at the end."""
        ctl = controller or AsyncController()
        try:
            [info] = await ctl.spawn_sandboxes(tag, n=1, **spawn_kwargs)
        except BaseException:
            if controller is None:
                await ctl.aclose()
            raise
        return cls(ctl, info, owns=controller is None)

    @classmethod
    async def connect(
        cls, sandbox_id: str, *, controller: AsyncController | None = None
    ) -> AsyncSandbox:
        """The running sandbox ``sandbox_id``."""
        ctl = controller or AsyncController()
        try:
            info = await ctl.get_sandbox(sandbox_id)
        except BaseException:
            if controller is None:
                await ctl.aclose()
            raise
        return cls(ctl, info, owns=controller is None)

    @property
    def controller(self) -> AsyncController:
        return self._controller

    async def refresh(self) -> JSONDict:
        self._info = await self._controller.get_sandbox(self.id)
        return self._info

    async def update(
        self, *, evictable: bool | None = None, auto_resume: bool | None = None
    ) -> JSONDict:
        """See ``Sandbox.update``."""
        self._info = await self._controller.update_sandbox(
            self.id, evictable=evictable, auto_resume=auto_resume
        )
        return self._info

    async def get_metrics(self) -> JSONDict:
        """What the sandbox uses now (see ``Sandbox.get_metrics``)."""
        return await self._controller.sandbox_metrics(self.id)

    async def ping(self) -> JSONDict:
        return await self._controller.ping_sandbox(self.id)

    async def eval(self, code: str, timeout: float | None = None) -> EvalResult:
        """Python in the sandbox's persistent interpreter (see ``Sandbox.eval``)."""
        return EvalResult.from_answer(await self._controller.eval_code(self.id, code, timeout))

    async def interrupt(self) -> bool:
        return bool((await self._controller.interrupt_eval(self.id))["interrupted"])

    async def set_timeout(self, timeout_s: float | None, idle_timeout_s: Any = KEEP) -> JSONDict:
        self._info = await self._controller.set_sandbox_timeout(self.id, timeout_s, idle_timeout_s)
        return self._info

    async def pause(self, hibernate: bool = False) -> JSONDict:
        self._info = await self._controller.pause_sandbox(self.id, hibernate=hibernate)
        return self._info

    async def hibernate(self) -> JSONDict:
        return await self.pause(hibernate=True)

    async def resume(self, timeout_s: float | None = None) -> JSONDict:
        self._info = await self._controller.resume_sandbox(self.id, timeout_s=timeout_s)
        return self._info

    async def branch(
        self,
        tag: str | None = None,
        mode: str | None = None,
        metadata: dict[str, str] | None = None,
        wait: bool = True,
    ) -> AsyncSnapshot:
        """Snapshot this sandbox (see ``Sandbox.branch``)."""
        from forkd.client.async_snapshot import AsyncSnapshot  # it forks AsyncSandboxes in turn

        info = await self._controller.branch_sandbox(
            self.id, tag=tag, mode=mode, metadata=metadata, wait=wait
        )
        return AsyncSnapshot(info["tag"], controller=self._controller, info=info)

    async def diff(
        self, path: str = "/", against: str | None = None, format: str = "json"
    ) -> DiffResult | str | bytes:
        """What this sandbox changed under ``path`` (see ``Sandbox.diff``): a
        ``DiffResult``, a patch (``format="patch"``) or a tar (``format="tar"``)."""
        return await self._controller.diff(self.id, path, against, format)

    async def explore(
        self,
        variants: Sequence[Step],
        score: Step | None = None,
        **options: Unpack[ExploreOptions],
    ) -> ExploreResult:
        """Try each variant in its own copy, score, keep the best (see ``Sandbox.explore``).
        Cancelling it cancels the explore: the daemon kills what it made."""
        return await self._controller.explore_sandbox(self.id, variants, score, **options)

    def get_url(self, port: int, path: str = "/") -> str:
        """The daemon's proxy URL of guest TCP ``port`` (it needs the bearer token)."""
        return str(self._controller.port_url(self.id, port, path))

    def websocket(
        self, port: int, path: str = "/", subprotocols: list[str] | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """``async with``: an httpx-ws ``AsyncWebSocketSession`` to ``path`` on guest ``port``."""
        return self._controller.port_websocket(self.id, port, path, subprotocols)

    async def preview_url(self, port: int, ttl_s: int | None = None) -> str:
        """A signed URL of guest ``port`` for a browser, no token needed."""
        return str((await self._controller.create_preview_url(self.id, port, ttl_s))["url"])

    async def kill(self) -> None:
        """Kill the sandbox; again (or one already gone) is a no-op."""
        if self._killed:
            return
        try:
            await self._controller.kill_sandbox(self.id)
        except ControllerError as exc:
            if exc.status != 404:
                raise
        self._killed = True

    @property
    def killed(self) -> bool:
        return self._killed

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        finally:
            if self._owns_controller:
                await self._controller.aclose()

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, snapshot={self.snapshot_tag!r})"
