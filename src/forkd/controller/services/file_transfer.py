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
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from forkd import limits
from forkd.controller.services import legacy_files
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.errors import Conflict, ForkdError, GuestError, GuestStorageFull, Invalid

T = TypeVar("T")

CHUNK_BYTES = 1 << 20  # of data in one agent request (the agent's cap)
# Agent requests of one transfer in flight at once, each way: the daemon holds
# this many chunks per transfer (plus a piece of the request body, or the chunk
# its client is taking). More do not help under TCG, where the guest's one vCPU
# both drains the channel and decodes: two in flight measured 30% slower.
WRITES_IN_FLIGHT = 1
READS_AHEAD = 1

# The guest's exceptions of the transfer ops, as forkd errors.
_TRANSFER_REFUSALS: dict[str, type[ForkdError]] = {
    "NoSpaceError": GuestStorageFull,
    "TransferGone": Conflict,  # dropped when idle, or by a fork of the sandbox
    "UnsafeArchiveError": Invalid,
    "BadArchiveError": Invalid,
    "UnsafeEntry": Invalid,  # forkd.archive's names, which the agent's answers carry now
    "BadArchive": Invalid,
    "ArchiveTooLarge": Invalid,
}


class CallsGuest(Protocol):
    """What runs a call on a sandbox's VM: the daemon's :class:`GuestCalls`, or one VM's
    own (a template being built)."""

    async def call(
        self,
        sandbox_id: str,
        call: Callable[[SandboxVM], Awaitable[T]],
        refusals: Mapping[str, type[ForkdError]] | None = None,
        wake: bool = True,
    ) -> T: ...


@dataclass(frozen=True)
class _Transfer:
    """An open upload: its id, and whether its agent takes chunks raw (``payload``)."""

    id: str
    payload: bool


@dataclass
class Download:
    """A file's bytes as they are read: ``size`` is None when unknown in advance (a tar)."""

    size: int | None
    chunks: AsyncIterator[bytes]


class FileTransferService:
    def __init__(self, guest: CallsGuest) -> None:
        self.guest = guest

    # ------------------------------------------------------------ upload

    async def upload(
        self, sandbox_id: str, path: str, body: AsyncIterator[bytes], *, tar: bool = False
    ) -> int:
        """Write ``body`` to ``path`` (a tar archive: extract it into the directory
        ``path``); the bytes taken. All of it lands, or nothing of a file does.

        The first chunk goes with the open; a file that fits in it is written and
        committed by that one request.
        """
        path = limits.check_guest_path(path)
        chunks = _whole_chunks(body)
        first = await anext(chunks, b"")
        whole = len(first) < CHUNK_BYTES and not tar  # the body ended within one chunk
        try:
            opened = await self._guest(
                sandbox_id, lambda vm: vm.guest.upload_open(path, first, tar=tar, commit=whole)
            )
        except Invalid:
            if not await legacy_files.predates_chunks(self._guest, sandbox_id):
                raise
            if tar:
                raise legacy_files.too_old("a tar upload") from None
            return await legacy_files.upload(self._guest, sandbox_id, path, first, chunks)
        if whole:
            return int(opened["size"])
        transfer = _Transfer(str(opened["transfer_id"]), payload=opened.get("payload") is True)
        transfer_id = transfer.id
        try:
            sent = await self._forward(sandbox_id, transfer, chunks, len(first))
            await self._guest(sandbox_id, lambda vm: vm.guest.upload_commit(transfer_id))
        except BaseException:
            await self._abort(sandbox_id, transfer_id)
            raise
        return sent

    async def _forward(
        self, sandbox_id: str, transfer: _Transfer, chunks: AsyncIterator[bytes], sent: int
    ) -> int:
        """Send the chunks from offset ``sent``, WRITES_IN_FLIGHT at once at most; the
        next chunk is read from the client while one is written."""
        writing: deque[asyncio.Task[int]] = deque()
        try:
            async for chunk in chunks:
                if len(writing) >= WRITES_IN_FLIGHT:
                    await writing.popleft()
                writing.append(self._write_soon(sandbox_id, transfer, sent, chunk))
                sent += len(chunk)
            while writing:
                await writing.popleft()
        finally:
            await _cancel(writing)  # after a failure: the rest are moot
        return sent

    def _write_soon(
        self, sandbox_id: str, transfer: _Transfer, offset: int, chunk: bytes
    ) -> asyncio.Task[int]:
        def write(vm: SandboxVM) -> Awaitable[int]:
            return vm.guest.upload_write(transfer.id, offset, chunk, payload=transfer.payload)

        return asyncio.ensure_future(self._guest(sandbox_id, write))

    async def _abort(self, sandbox_id: str, transfer_id: str) -> None:
        """Tell the guest to drop the transfer; a guest that cannot hear it expires it."""
        call = self._guest(sandbox_id, lambda vm: vm.guest.transfer_abort(transfer_id))
        with contextlib.suppress(ForkdError, asyncio.CancelledError):
            await asyncio.shield(call)

    # ------------------------------------------------------------ download

    async def download(self, sandbox_id: str, path: str) -> Download:
        """The file at ``path``; its first chunk is read (and any error raised) here."""
        path = limits.check_guest_path(path)
        try:
            first, size, eof = await self._read(sandbox_id, path, 0)
        except Invalid:
            if not await legacy_files.predates_chunks(self._guest, sandbox_id):
                raise
            data = await legacy_files.download(self._guest, sandbox_id, path)
            return Download(len(data), _once(data))
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
        """Exactly ``size`` bytes, READS_AHEAD chunks asked for ahead of the consumer: a
        file that grows is cut there; one that shrinks fails the stream, so the client
        sees it short rather than padded."""
        yield first
        offsets = iter(range(len(first), size, CHUNK_BYTES))
        ahead: deque[asyncio.Task[tuple[bytes, int | None, bool]]] = deque()

        def read_next() -> None:
            offset = next(offsets, None)
            if offset is not None:
                length = min(CHUNK_BYTES, size - offset)
                ahead.append(asyncio.ensure_future(self._read(sandbox_id, path, offset, length)))

        got = len(first)
        try:
            for _ in range(READS_AHEAD):
                read_next()
            while ahead:
                data, _, eof = await ahead.popleft()
                read_next()
                got += len(data)
                if data:
                    yield data
                if eof and got < size:
                    raise GuestError(f"{path} shrank to {got} bytes while it was read")
        finally:
            await _cancel(ahead)

    async def _read(
        self, sandbox_id: str, path: str, offset: int, length: int = CHUNK_BYTES
    ) -> tuple[bytes, int | None, bool]:
        return await self._guest(sandbox_id, lambda vm: vm.guest.read_range(path, offset, length))

    async def download_tar(self, sandbox_id: str, path: str) -> Download:
        """The directory at ``path`` as a tar stream of its content (members ``./...``)."""
        path = limits.check_guest_path(path)
        try:
            transfer_id = await self._guest(sandbox_id, lambda vm: vm.guest.tar_open(path))
        except Invalid:
            if await legacy_files.predates_chunks(self._guest, sandbox_id):
                raise legacy_files.too_old("a tar download") from None
            raise
        return Download(None, self._tar_chunks(sandbox_id, transfer_id))

    async def download_paths(self, sandbox_id: str, paths: list[str]) -> Download:
        """The files at ``paths`` as a tar stream (members named by their paths)."""
        transfer_id = await self._guest(sandbox_id, lambda vm: vm.guest.tar_open_paths(paths))
        return Download(None, self._tar_chunks(sandbox_id, transfer_id))

    def stream(self, sandbox_id: str, transfer_id: str) -> AsyncGenerator[bytes, None]:
        """The bytes of an open download (a tar, a manifest), a chunk at a time; one
        left before its end is aborted."""
        return self._tar_chunks(sandbox_id, transfer_id)

    async def head(self, sandbox_id: str, path: str, length: int) -> tuple[bytes, bool]:
        """The first ``length`` bytes of the file at ``path``, and whether that is all."""
        data, _, eof = await self._read(sandbox_id, path, 0, length)
        return data, eof

    async def _tar_chunks(self, sandbox_id: str, transfer_id: str) -> AsyncGenerator[bytes, None]:
        eof = False
        try:
            while not eof:
                data, eof = await self._guest(
                    sandbox_id, lambda vm: vm.guest.tar_read(transfer_id, CHUNK_BYTES)
                )
                if data:
                    yield data
        finally:
            if not eof:
                await self._abort(sandbox_id, transfer_id)

    async def _guest(self, sandbox_id: str, call: Callable[[SandboxVM], Awaitable[T]]) -> T:
        return await self.guest.call(sandbox_id, call, _TRANSFER_REFUSALS)


async def _whole_chunks(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``body`` regrouped in chunks of CHUNK_BYTES; only the last may be shorter."""
    pending = bytearray()
    async for piece in body:
        pending += piece
        while len(pending) >= CHUNK_BYTES:
            yield bytes(pending[:CHUNK_BYTES])
            del pending[:CHUNK_BYTES]
    if pending:
        yield bytes(pending)


async def _cancel(tasks: deque[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
