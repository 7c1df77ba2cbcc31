"""A snapshot as an asyncio object: :class:`AsyncSnapshot`, to fork
:class:`~forkd.client.AsyncSandbox` children from (see :mod:`forkd.client.snapshot`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from forkd.client.async_controller import AsyncController
from forkd.client.async_sandbox import AsyncSandbox
from forkd.client.connection import JSONDict
from forkd.client.views import WRITING, SnapshotView


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
