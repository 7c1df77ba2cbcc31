"""``forkd mcp`` on real VMs: the official ``mcp`` client lists the tools and calls each
one (create, fork, exec, run Python, files, branch, list, kill) and reads the lineage
tree, against the suite's daemon; and imports a busybox-only container image, makes a
template of it with its service started, and runs a command in a fork as the image's
user."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from forkd import mcp_server
from forkd.client import AsyncController, ControllerError
from tests import oci_images
from tests.integration.test_container_images import busybox_image
from tests.unit.test_mcp_server import (
    exercise_every_tool,
    exercise_the_image_tools,
    exercise_the_original_tools,
)

pytestmark = pytest.mark.integration


def test_every_tool_on_real_vms(daemon: Any, api_template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(daemon.url, token=daemon.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_every_tool(client, api_template, "mcp-branch")
        async with AsyncController(daemon.url, token=daemon.token) as ctl:
            await ctl.delete_snapshot("mcp-branch")

    asyncio.run(session())


def test_the_original_forkd_tools_on_real_vms(daemon: Any, api_template: str) -> None:
    built = mcp_server.build(lambda: AsyncController(daemon.url, token=daemon.token))

    async def session() -> None:
        async with Client(built) as client:
            await exercise_the_original_tools(client, api_template, "mcp-original")
        async with AsyncController(daemon.url, token=daemon.token) as ctl:
            for tag in ("mcp-original-m", "mcp-original"):
                await ctl.delete_snapshot(tag)

    asyncio.run(session())


def test_the_image_tools_on_real_vms(daemon: Any, tmp_path: Path) -> None:
    archive = oci_images.write_oci_archive(tmp_path / "busybox.tar", {"1": busybox_image()})
    built = mcp_server.build(lambda: AsyncController(daemon.url, token=daemon.token))

    async def session() -> None:
        try:
            async with Client(built) as client:
                await exercise_the_image_tools(
                    client,
                    f"oci-archive:{archive}:1",
                    f"oci-archive:{archive}:nosuch",
                    "mcp-busybox",
                    8080,
                    "app",
                )
        finally:
            async with AsyncController(daemon.url, token=daemon.token) as ctl:
                with contextlib.suppress(ControllerError):  # not made: the failure above
                    await ctl.delete_snapshot("mcp-busybox")

    asyncio.run(session())
