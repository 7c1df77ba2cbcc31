"""Files of any size moved in and out of a sandbox, one chunk at a time.

An upload opens a staged file in the guest (docs/guest-agent.md, "Chunked
transfers"), forwards the body in chunks of :data:`CHUNK_BYTES` and commits
at the end, which renames the staged file into place; any failure, or a
client that goes away, aborts it and the guest removes the staged file. A
download reads ranges of the file as its consumer takes them. Either way the
daemon holds one chunk per transfer, whatever the file's size, and the limit
is the guest's free space: a full disk is :class:`GuestStorageFull`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from forkd import limits
from forkd.controller.services.sandboxes import SandboxService
from forkd.errors import Conflict, ForkdError, GuestError, GuestStorageFull, Invalid

T = TypeVar("T")

CHUNK_BYTES = 1 << 20  # of data in one agent request (the agent's cap)

# The guest's exceptions of the transfer ops, as forkd errors.
_TRANSFER_REFUSALS: dict[str, type[ForkdError]] = {
    "NoSpaceError": GuestStorageFull,
    "TransferGone": Conflict,  # dropped when idle, or by a fork of the sandbox
    "UnsafeArchiveError": Invalid,
}


@dataclass
class Download:
    """A file's bytes as they are read: ``size`` is None when unknown in advance (a tar)."""

    size: int | None
    chunks: AsyncIterator[bytes]


class FileTransferService:
    def __init__(self, sandboxes: SandboxService) -> None:
        self.sandboxes = sandboxes

    # ------------------------------------------------------------ upload

    async def upload(
        self, sandbox_id: str, path: str, body: AsyncIterator[bytes], *, tar: bool = False
    ) -> int:
        """Write ``body`` to ``path`` (a tar archive: extract it into the directory
        ``path``); the bytes taken. All of it lands, or nothing of a file does."""
        path = limits.check_guest_path(path)
        transfer_id = await self._guest(sandbox_id, lambda vm: vm.upload_open(path, tar=tar))
        try:
            sent = await self._forward(sandbox_id, transfer_id, body)
            await self._guest(sandbox_id, lambda vm: vm.upload_commit(transfer_id))
        except BaseException:
            await self._abort(sandbox_id, transfer_id)
            raise
        return sent

    async def _forward(self, sandbox_id: str, transfer_id: str, body: AsyncIterator[bytes]) -> int:
        """Send ``body`` in whole chunks; the next chunk is read while one is written."""
        pending = bytearray()
        sent = 0
        writing: asyncio.Task[int] | None = None
        try:
            async for piece in body:
                pending += piece
                while len(pending) >= CHUNK_BYTES:
                    chunk = bytes(pending[:CHUNK_BYTES])
                    del pending[:CHUNK_BYTES]
                    if writing is not None:
                        await writing
                    writing = self._write_soon(sandbox_id, transfer_id, sent, chunk)
                    sent += len(chunk)
            if writing is not None:
                await writing
            if pending:
                await self._write_soon(sandbox_id, transfer_id, sent, bytes(pending))
                sent += len(pending)
        finally:
            if writing is not None:  # done: its error, if any, is already raised
                writing.cancel()
                with contextlib.suppress(BaseException):
                    await writing
        return sent

    def _write_soon(
        self, sandbox_id: str, transfer_id: str, offset: int, chunk: bytes
    ) -> asyncio.Task[int]:
        return asyncio.ensure_future(
            self._guest(sandbox_id, lambda vm: vm.upload_write(transfer_id, offset, chunk))
        )

    async def _abort(self, sandbox_id: str, transfer_id: str) -> None:
        """Tell the guest to drop the transfer; a guest that cannot hear it expires it."""
        call = self._guest(sandbox_id, lambda vm: vm.transfer_abort(transfer_id))
        with contextlib.suppress(ForkdError, asyncio.CancelledError):
            await asyncio.shield(call)

    # ------------------------------------------------------------ download

    async def download(self, sandbox_id: str, path: str) -> Download:
        """The file at ``path``; its first chunk is read (and any error raised) here."""
        path = limits.check_guest_path(path)
        first, size, eof = await self._read(sandbox_id, path, 0)
        if eof:
            return Download(len(first), _once(first))
        if size is None or size <= len(first):
            raise Invalid(
                f"{path} reports no size (a device or a /proc file) and is longer than "
                f"{CHUNK_BYTES} bytes: read it with a command instead"
            )
        return Download(size, self._ranges(sandbox_id, path, first, size))

    async def _ranges(
        self, sandbox_id: str, path: str, first: bytes, size: int
    ) -> AsyncIterator[bytes]:
        """Exactly ``size`` bytes: a file that grows is cut there; one that shrinks
        fails the stream, so the client sees it short rather than padded."""
        yield first
        offset = len(first)
        while offset < size:
            data, _, eof = await self._read(
                sandbox_id, path, offset, min(CHUNK_BYTES, size - offset)
            )
            offset += len(data)
            if data:
                yield data
            if eof and offset < size:
                raise GuestError(f"{path} shrank to {offset} bytes while it was read")

    async def _read(
        self, sandbox_id: str, path: str, offset: int, length: int = CHUNK_BYTES
    ) -> tuple[bytes, int | None, bool]:
        return await self._guest(sandbox_id, lambda vm: vm.read_range(path, offset, length))

    async def download_tar(self, sandbox_id: str, path: str) -> Download:
        """The directory at ``path`` as a tar stream of its content (members ``./...``)."""
        path = limits.check_guest_path(path)
        transfer_id = await self._guest(sandbox_id, lambda vm: vm.tar_open(path))
        return Download(None, self._tar_chunks(sandbox_id, transfer_id))

    async def _tar_chunks(self, sandbox_id: str, transfer_id: str) -> AsyncIterator[bytes]:
        eof = False
        try:
            while not eof:
                data, eof = await self._guest(
                    sandbox_id, lambda vm: vm.tar_read(transfer_id, CHUNK_BYTES)
                )
                if data:
                    yield data
        finally:
            if not eof:
                await self._abort(sandbox_id, transfer_id)

    async def _guest(self, sandbox_id: str, call: Callable[[Any], Awaitable[T]]) -> T:
        return await self.sandboxes.guest(sandbox_id, call, _TRANSFER_REFUSALS)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
