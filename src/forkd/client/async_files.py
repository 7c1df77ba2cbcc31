"""``sandbox.files`` of an :class:`~forkd.client.AsyncSandbox`: files and directories in
and out of the sandbox, streamed (see :mod:`forkd.client.files`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from forkd.client.async_controller import AsyncController
from forkd.client.connection import JSONDict
from forkd.client.files import WriteData, _body, _file_chunks
from forkd.client.local_file import staged_file
from forkd.client.tar_stream import extract_chunks, tar_chunks

if TYPE_CHECKING:
    from forkd.client.async_sandbox import AsyncSandbox


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
