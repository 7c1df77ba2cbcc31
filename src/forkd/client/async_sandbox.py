"""Sandboxes and snapshots as asyncio objects: :class:`AsyncSandbox`, :class:`AsyncSnapshot`.

They mirror :class:`~forkd.client.Sandbox` and :class:`~forkd.client.Snapshot`
method for method, awaited, over an :class:`~forkd.client.AsyncController`; the
answers are the same result types (``CommandResult``, ``EvalResult``, SandboxInfo
dicts); a background command is an :class:`AsyncCommandHandle`, a terminal an
``AsyncPtyHandle``, output and file contents async iterators.

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

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Unpack

from forkd.client.async_controller import AsyncController
from forkd.client.async_sockets import AsyncPtyHandle
from forkd.client.commands import FOREGROUND_TIMEOUT_SECS, HandleOutput
from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.explore import DiffResult, ExploreOptions, ExploreResult, Step
from forkd.client.files import WriteData, _body, _file_chunks
from forkd.client.local_file import staged_file
from forkd.client.pty import LOGIN_SHELL, DataCallback
from forkd.client.results import CommandResult, EvalResult, OutputEvent
from forkd.client.routes import KEEP
from forkd.client.tar_stream import extract_chunks, tar_chunks
from forkd.client.views import WRITING, SandboxView, SnapshotView


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


class AsyncFiles:
    """``sandbox.files``: files in and out of the sandbox, streamed (see ``Files``)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    @property
    def _ctl(self) -> AsyncController:
        return self._sandbox.controller

    async def stream(self, path: str, tar: bool = False) -> AsyncIterator[bytes]:
        """The file's chunks as they come (one in memory at a time)."""
        async with self._ctl.download_file(self._sandbox.id, path, tar=tar) as (_, chunks):
            async for chunk in chunks:
                yield chunk

    async def read(self, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.stream(path)])

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def write(self, path: str, data: WriteData | AsyncIterable[bytes]) -> JSONDict:
        """Create or replace a file, atomically (see ``Files.write``); ``data`` may also
        be an async iterable of chunks."""
        body = data if isinstance(data, AsyncIterable) else _body(data)
        return await self._ctl.upload_file(self._sandbox.id, path, body)

    async def upload(self, local_path: str | os.PathLike[str], path: str) -> JSONDict:
        """Copy a local file, or a local directory's content (a tar stream), to ``path``."""
        local = Path(local_path)
        if local.is_dir():
            return await self._ctl.upload_file(self._sandbox.id, path, tar_chunks(local), tar=True)
        with local.open("rb") as f:
            return await self._ctl.upload_file(self._sandbox.id, path, _file_chunks(f))

    async def download(
        self, path: str, local_path: str | os.PathLike[str], *, directory: bool = False
    ) -> int:
        """Copy the file ``path`` to ``local_path`` (replaced once all of it came), or
        with ``directory`` the directory's content into ``local_path`` → bytes received."""
        local = Path(local_path)
        if directory:
            return await self._download_directory(path, local)
        moved = 0
        with staged_file(local) as f:
            async for chunk in self.stream(path):
                f.write(chunk)
                moved += len(chunk)
        return moved

    async def _download_directory(self, path: str, local: Path) -> int:
        """The tar stream unpacked as it comes, on a thread that asks this loop for each
        chunk: never more of it on disk or in memory than the extractor let through."""
        loop = asyncio.get_running_loop()
        moved = 0
        async with self._ctl.download_file(self._sandbox.id, path, tar=True) as (_, chunks):

            async def next_chunk() -> bytes:
                return await anext(chunks)

            def pulled() -> Iterator[bytes]:
                nonlocal moved
                while True:
                    try:
                        chunk = asyncio.run_coroutine_threadsafe(next_chunk(), loop).result()
                    except StopAsyncIteration:
                        return
                    moved += len(chunk)
                    yield chunk

            await asyncio.to_thread(extract_chunks, pulled(), local)
        return moved

    async def list(self, path: str) -> list[JSONDict]:
        return await self._ctl.list_files(self._sandbox.id, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._ctl.remove_file(self._sandbox.id, path, recursive)


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


class AsyncSnapshot(SnapshotView):
    """A snapshot on the daemon, to fork :class:`AsyncSandbox` children from."""

    def __init__(
        self, tag: str, *, controller: AsyncController, info: JSONDict | None = None
    ) -> None:
        self.tag = tag
        self._controller = controller
        self._info = info or {"tag": tag}

    @classmethod
    async def create(
        cls,
        tag: str,
        *,
        controller: AsyncController,
        image: str | None = None,
        start: bool | None = None,
        ready_port: int | None = None,
        ready_cmd: list[str] | str | None = None,
        ready_timeout_secs: float | None = None,
        **kwargs: Any,
    ) -> AsyncSnapshot:
        """Build a template, as :meth:`Snapshot.create`: ``image`` a built image's name
        or a container image reference (imported first); ``start`` runs its
        Entrypoint+Cmd until ``ready_port`` listens or ``ready_cmd`` exits 0 (within
        ``ready_timeout_secs``); other keywords as ``create_snapshot``.

        Example::

            pg = await AsyncSnapshot.create("pg", controller=ctl, image="oci:/srv/pg:16",
                                            start=True, ready_port=5432)
        """
        info = await controller.create_snapshot(
            tag,
            image=image,
            start=start,
            ready_port=ready_port,
            ready_cmd=ready_cmd,
            ready_timeout_secs=ready_timeout_secs,
            **kwargs,
        )
        return cls(info.get("tag", tag), controller=controller, info=info)

    @classmethod
    async def get(cls, tag: str, *, controller: AsyncController) -> AsyncSnapshot:
        return cls(tag, controller=controller, info=await controller.snapshot(tag))

    @property
    def controller(self) -> AsyncController:
        return self._controller

    @property
    def info(self) -> JSONDict:
        return self._info

    async def refresh(self) -> JSONDict:
        self._info = await self._controller.snapshot_info(self.tag)
        return self._info

    async def fork(self, n: int = 1, **spawn_kwargs: Any) -> list[AsyncSandbox]:
        """Fork ``n`` sandboxes (all or nothing)."""
        infos = await self._controller.spawn_sandboxes(self.tag, n=n, **spawn_kwargs)
        return [AsyncSandbox(self._controller, info) for info in infos]

    async def wait(self, timeout: float = 600.0, interval: float = 0.2) -> AsyncSnapshot:
        """Poll until no longer ``pending``; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._info = await self._controller.snapshot(self.tag)
            if self.status not in WRITING:
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"snapshot {self.tag!r} still pending after {timeout:g} s")
            await asyncio.sleep(interval)

    async def compact(self) -> JSONDict:
        self._info = await self._controller.compact_snapshot(self.tag)
        return self._info

    async def push(self, ref: str, **options: Any) -> JSONDict:
        """As :meth:`Snapshot.push`."""
        return await self._controller.push_snapshot(self.tag, ref, **options)

    @classmethod
    async def pull(
        cls, ref: str, tag: str | None = None, *, controller: AsyncController, **options: Any
    ) -> AsyncSnapshot:
        """As :meth:`Snapshot.pull`."""
        info = await controller.pull_snapshot(ref, tag, **options)
        return cls(info["tag"], controller=controller, info=info)

    async def delete(self, cascade: bool = False, force: bool = False) -> None:
        await self._controller.delete_snapshot(self.tag, cascade=cascade, force=force)

    def __repr__(self) -> str:
        return f"AsyncSnapshot({self.tag!r})"
