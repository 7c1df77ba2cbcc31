"""``forkd mcp`` on real VMs: the official ``mcp`` client lists the tools and calls each
one (create, fork, exec, run Python, files, branch, list, kill) and reads the lineage
tree, against the suite's daemon."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mcp import Client

from forkd import mcp_server
from forkd.client import AsyncController
from tests.unit.test_mcp_server import exercise_every_tool

pytestmark = pytest.mark.integration


def test_every_tool_on_real_vms(daemon: Any, api_template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(daemon.url, token=daemon.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_every_tool(client, api_template, "mcp-branch")
        async with AsyncController(daemon.url, token=daemon.token) as ctl:
            await ctl.delete_snapshot("mcp-branch")

    asyncio.run(session())
