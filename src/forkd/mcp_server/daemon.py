"""How an MCP tool reaches the daemon: a client for each call, its errors as the tool's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.mcpserver.exceptions import ToolError

from forkd.client import AsyncController, ControllerError

# How a tool reaches the daemon: a client for the call, its errors as tool errors.
WithDaemon = Callable[[Callable[[AsyncController], Awaitable[Any]]], Awaitable[Any]]


async def answer(call: Awaitable[Any]) -> Any:
    """The daemon's answer, or its error as the tool's error (the agent reads it)."""
    try:
        return await call
    except ControllerError as exc:
        raise ToolError(str(exc)) from exc


def reaching(connect: Callable[[], AsyncController]) -> WithDaemon:
    """A :data:`WithDaemon` that makes each call's client with ``connect``."""

    async def with_daemon(use: Callable[[AsyncController], Awaitable[Any]]) -> Any:
        async with connect() as ctl:
            return await answer(use(ctl))

    return with_daemon
