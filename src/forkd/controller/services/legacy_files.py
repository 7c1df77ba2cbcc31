"""Files in a sandbox whose guest agent predates the chunked transfers: whole files only.

A sandbox forked from a snapshot taken before forkd streamed files runs that
snapshot's agent, held in its memory. It answers the chunked ops as unknown
(kind ``ValueError``), but still has ``file_read`` and ``file_write``, which
move a whole file of up to 32 MiB in one request, as forkd did then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.errors import Conflict, Invalid

MAX_BYTES = 32 << 20  # the older agent's MAX_FILE_BYTES
PROBE_ID = "forkd-probe"  # a transfer id no agent hands out (they are 16 hex digits)

T = TypeVar("T")


class GuestCall(Protocol):
    """``call(vm)`` on the sandbox's VM, its agent's refusals classified
    (:meth:`forkd.controller.services.file_transfer.FileTransferService._guest`)."""

    def __call__(
        self, sandbox_id: str, call: Callable[[SandboxVM], Awaitable[T]], /
    ) -> Awaitable[T]: ...


async def predates_chunks(guest: GuestCall, sandbox_id: str) -> bool:
    """Whether the sandbox's agent lacks the chunked ops. Asked after one of them was
    refused as malformed: aborting a transfer that does not exist is answered by a
    current agent, and refused only by an older one."""
    try:
        await guest(sandbox_id, lambda vm: vm.guest.transfer_abort(PROBE_ID))
    except Invalid:
        return True
    return False


def too_old(what: str) -> Conflict:
    return Conflict(
        f"{what} needs a newer guest agent than this sandbox's (its snapshot predates "
        "streamed files): fork it from a snapshot built by this forkd"
    )


async def upload(
    guest: GuestCall, sandbox_id: str, path: str, first: bytes, rest: AsyncIterator[bytes]
) -> int:
    """The whole body, up to MAX_BYTES, written by one ``file_write``."""
    data = bytearray(first)
    async for chunk in rest:
        data += chunk
        if len(data) > MAX_BYTES:
            raise Invalid(
                f"this sandbox's guest agent takes files of at most {MAX_BYTES} bytes "
                "(its snapshot predates streamed files); nothing was written"
            )
    return await guest(sandbox_id, lambda vm: vm.guest.write_file(path, bytes(data)))


async def download(guest: GuestCall, sandbox_id: str, path: str) -> bytes:
    """The whole file by one ``file_read`` (the agent refuses one over MAX_BYTES)."""
    return await guest(sandbox_id, lambda vm: vm.guest.read_file(path))
