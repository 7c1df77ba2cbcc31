"""forkd's MCP tools on images and templates: a container image imported, the images
listed, a snapshot made from one (its service started first)."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context, MCPServer

from forkd.mcp_server.daemon import WithDaemon


def image_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """Images, and the snapshots made from them."""

    @server.tool()
    async def import_image(ref: str, ctx: Context) -> dict[str, Any]:
        """Import a container image so snapshots can be made from it: a registry
        reference (``registry.example.com/team/app:1``), ``docker-daemon:IMAGE``,
        ``docker-archive:PATH``, ``oci-archive:PATH[:tag]`` or ``oci:DIR[:tag]`` (paths
        on the daemon's host). Reports each step as progress; returns the image's
        info (its ``name``, config, ``bytes_fetched`` and ``bytes_reused``)."""
        steps = 0

        async def report(message: str) -> None:
            nonlocal steps
            steps += 1
            await ctx.report_progress(steps, None, message)

        return dict(await with_daemon(lambda c: c.import_image_progress(ref, report)))

    @server.tool()
    async def list_images() -> list[dict[str, Any]]:
        """The images snapshots can be made from: built from recipes (``kind``
        recipe) and imported container images (``kind`` container, with their config
        and the references they were imported as)."""
        return list(await with_daemon(lambda c: c.list_images()))


def snapshot_tools(server: MCPServer, with_daemon: WithDaemon) -> None:
    """A template built (and, from a container image, imported first)."""

    @server.tool()
    async def create_snapshot(
        tag: str,
        image: str | None = None,
        start: bool = False,
        ready_port: int | None = None,
        ready_cmd: str | None = None,
        warmup: str | None = None,
        memory_mib: int | None = None,
        kernel: str | None = None,
        rootfs: str | None = None,
        rw: bool = False,
        tap: str | None = None,
        boot_wait_secs: float | None = None,
    ) -> dict[str, Any]:
        """Make a new snapshot ``tag`` to create sandboxes from. ``image``: a built
        image's name (list_images; default python) or a container image reference,
        imported first. ``start``: run the image's Entrypoint+Cmd before the snapshot
        and wait until guest TCP ``ready_port`` listens or the shell line ``ready_cmd``
        exits 0, so every sandbox starts with that service already running.
        ``warmup``: Python run in the warm interpreter first. Takes seconds to minutes.
        The original forkd's ``kernel`` and ``rootfs`` (files of a built image on the
        daemon's host), ``rw``, ``tap`` and ``boot_wait_secs`` are taken too."""
        extra: dict[str, Any] = {
            k: v for k, v in (("kernel", kernel), ("rootfs", rootfs), ("tap", tap)) if v
        }
        if rw:
            extra["rw"] = True
        answer = await with_daemon(
            lambda c: c.create_snapshot(
                tag,
                image=image,
                warmup=warmup,
                memory_mib=memory_mib,
                start=start or None,
                ready_port=ready_port,
                ready_cmd=ready_cmd,
                boot_wait_secs=boot_wait_secs,
                **extra,
            )
        )
        return dict(answer)
