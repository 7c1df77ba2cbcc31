"""A request body a client sends to be kept (an image archive, a volume's disk image),
written to a file of the daemon's as it arrives: bounded in size and by the disk reserve,
written off the event loop a piece at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import BinaryIO

from forkd.disk_reserve import WriteMeter
from forkd.errors import Invalid

WRITE_PIECE = 1 << 20  # an upload is written to disk, off the event loop, this much at once


async def receive_to(
    body: AsyncIterator[bytes],
    out: BinaryIO,
    cap: int,
    meter: WriteMeter,
    what: str = "the body",
    cap_flag: str = "",
) -> int:
    """Write ``body`` to ``out`` as it arrives; its size. 400 past ``cap`` bytes (the
    guard middleware cuts the body there too), 507 once the disk is down to its
    reserve, 400 for an empty body."""
    size = held = 0
    pending: list[bytes] = []
    async for piece in body:
        size += len(piece)
        if size > cap:
            flag = f" (the daemon's {cap_flag})" if cap_flag else ""
            raise Invalid(f"{what} is over {cap} bytes{flag}")
        pending.append(piece)
        held += len(piece)
        if held >= WRITE_PIECE:
            meter.will_write(held)
            await asyncio.to_thread(out.write, b"".join(pending))
            pending, held = [], 0
    meter.will_write(held)
    await asyncio.to_thread(out.write, b"".join(pending))
    if size == 0:
        raise Invalid(f"the request has no body: send {what}")
    return size
