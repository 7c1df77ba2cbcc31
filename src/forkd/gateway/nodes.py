"""The daemons behind a gateway, and whether each answers.

Each node is polled (``GET /v1/capacity``) every :data:`POLL_SECS`. A node is
``up`` while it answers, and ``down`` once it has not for :data:`DOWN_AFTER_SECS`
(or was never reached): a node that stops answering is down within
``DOWN_AFTER_SECS + POLL_SECS + TIMEOUT`` (10 s). Requests for its sandboxes
then get a 503 naming it, and placement skips it until it answers again.

Nodes are given as URLs, or found in DNS: every poll, a name (a Kubernetes
headless Service) is resolved and each address is a node on ``port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

POLL_SECS = 2.0
DOWN_AFTER_SECS = 5.0
TIMEOUT = httpx.Timeout(2.5, connect=2.0)
Resolver = Callable[[str], list[str]]


@dataclass
class Node:
    url: str
    node_id: str | None = None  # the daemon's sandbox id prefix, once it answered
    capacity: dict[str, Any] = field(default_factory=dict)
    last_ok: float | None = None  # monotonic time of the last answer
    error: str | None = None
    discovered: bool = False  # found in DNS (dropped when the name no longer holds it)

    @property
    def up(self) -> bool:
        return self.last_ok is not None and time.monotonic() - self.last_ok < DOWN_AFTER_SECS

    @property
    def name(self) -> str:
        return f"{self.node_id or '?'} ({self.url})"

    @property
    def snapshots(self) -> set[str]:
        return set(self.capacity.get("snapshots") or [])

    def free(self, memory_mib: int) -> int:
        """How many more children of ``memory_mib`` MiB it can take, as it last said."""
        c = self.capacity
        room = 1 << 30
        if c.get("max_sandboxes") is not None:
            room = min(room, int(c["max_sandboxes"]) - int(c.get("sandboxes") or 0))
        if c.get("max_guest_memory_mib") is not None and memory_mib > 0:
            left = int(c["max_guest_memory_mib"]) - int(c.get("guest_memory_mib") or 0)
            room = min(room, left // memory_mib)
        return max(room, 0)

    def view(self) -> dict[str, Any]:
        seen = None if self.last_ok is None else round(time.monotonic() - self.last_ok, 1)
        return {
            "node_id": self.node_id,
            "url": self.url,
            "state": "up" if self.up else "down",
            "last_answer_s_ago": seen,
            "error": self.error,
            "capacity": {k: v for k, v in self.capacity.items() if k != "snapshots"},
            "snapshots": sorted(self.snapshots),
        }


def resolve_addresses(name: str) -> list[str]:
    """The addresses ``name`` resolves to (IPv4 and IPv6), sorted."""
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    return sorted({str(info[4][0]) for info in infos})


class NodeSet:
    def __init__(
        self,
        urls: list[str],
        token: str | None,
        *,
        dns_name: str | None = None,
        dns_port: int = 8889,
        resolver: Resolver = resolve_addresses,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.nodes: dict[str, Node] = {u.rstrip("/"): Node(u.rstrip("/")) for u in urls}
        self.token = token
        self.dns_name, self.dns_port, self.resolver = dns_name, dns_port, resolver
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=TIMEOUT, transport=transport)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ lookups

    def up(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.up]

    def by_id(self, node_id: str) -> Node | None:
        for node in self.nodes.values():
            if node.node_id == node_id:
                return node
        return None

    def holders(self, tag: str) -> list[Node]:
        return [n for n in self.up() if tag in n.snapshots]

    # ------------------------------------------------------------ polling

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    def poke(self) -> None:
        """Poll now (a request to a node just failed)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_SECS)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # never let the poller die
                log.exception("polling the nodes failed")

    async def refresh(self) -> None:
        if self.dns_name:
            await self._discover()
        await asyncio.gather(*(self._poll(n) for n in list(self.nodes.values())))

    async def refresh_one(self, node: Node) -> None:
        """Poll ``node`` now (it has just changed: a snapshot made or pulled)."""
        await self._poll(node)

    async def _discover(self) -> None:
        try:
            found = await asyncio.to_thread(self.resolver, self.dns_name or "")
        except OSError as exc:
            log.warning("resolving %s failed: %s", self.dns_name, exc)
            return  # keep what we had: a DNS blip is not every node gone
        urls = {_url(address, self.dns_port) for address in found}
        for url in urls - self.nodes.keys():
            self.nodes[url] = Node(url, discovered=True)
            log.info("node %s found in DNS (%s)", url, self.dns_name)
        for url in [u for u, n in self.nodes.items() if n.discovered and u not in urls]:
            log.info("node %s left DNS (%s)", url, self.dns_name)
            del self.nodes[url]

    async def _poll(self, node: Node) -> None:
        try:
            r = await self.client.get(f"{node.url}/v1/capacity")
            r.raise_for_status()
            capacity = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            if node.up or node.error is None:
                log.warning("node %s does not answer: %s", node.name, exc)
            node.error = str(exc) or type(exc).__name__
            return
        if node.error is not None or node.last_ok is None:
            log.info("node %s is up", node.url)
        node.capacity = capacity if isinstance(capacity, dict) else {}
        node.node_id = str(node.capacity.get("node_id") or "") or None
        node.last_ok, node.error = time.monotonic(), None


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"
