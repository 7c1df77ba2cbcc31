"""Work a request does only for its client: stopped when the client goes away.

Most routes finish their work whether or not anybody waits for the answer (a
fork that was asked for is made). A long one whose result is only an answer (an
explore: minutes of variants) is cancelled instead, so its work is taken back
(:mod:`forkd.controller.services.explore`) rather than left running for nobody.
A client that half-closes its connection after its request reads as gone; so
does one behind a proxy that closes early. Through ``forkd gateway`` the node
does not see the end client leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client went away before the answer; the work was cancelled."""


async def _until_gone(request: Request) -> None:
    # The body was read whole before the route ran: what comes next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; :class:`ClientGone` once ``work`` was cancelled (and finished
    being cancelled) because the client disconnected first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:  # cannot tell: let it run
            log.error("watching for the client to leave failed: %r", watcher.exception())
            await task
    finally:
        if not task.done():  # the client left, or this request itself was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientGone("the client went away: the work was cancelled")
    return task.result()
