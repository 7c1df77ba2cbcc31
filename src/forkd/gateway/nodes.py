"""The daemons behind a gateway, and whether each answers.

Each node is polled (``GET /v1/capacity``) by a task of its own, every
:data:`POLL_SECS` and at once when a request to it failed, so one slow node
or a slow resolver never ages the others. A node is ``up`` once it answered
and ``down`` after :data:`FAILURES_DOWN` polls in a row failed: a node that
stops answering is down within ``2 * (POLL_SECS + TIMEOUT)`` (9 s). Requests
for its sandboxes then get a 503 naming it, and placement skips it until it
answers again.

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
FAILURES_DOWN = 2
TIMEOUT = httpx.Timeout(2.5, connect=2.0)
RESOLVE_TIMEOUT_SECS = 2.0
Resolver = Callable[[str], list[str]]


@dataclass
class Node:
    url: str
    node_id: str | None = None  # the daemon's sandbox id prefix, once it answered
    capacity: dict[str, Any] = field(default_factory=dict)
    last_ok: float | None = None  # monotonic time of the last answer
    error: str | None = None
    discovered: bool = False  # found in DNS (dropped when the name no longer holds it)
    failures: int = 0  # polls failed in a row
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def up(self) -> bool:
        return self.last_ok is not None and self.failures < FAILURES_DOWN

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
        self._pollers: dict[str, asyncio.Task[None]] = {}

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
        self._task = asyncio.create_task(self._discovery_loop())
        self._start_pollers()

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._pollers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()

    def poke(self, node: Node | None = None) -> None:
        """Poll ``node`` (every node: ``None``) now: a request to it just failed."""
        for n in [node] if node is not None else list(self.nodes.values()):
            n.wake.set()

    def _start_pollers(self) -> None:
        for url, node in self.nodes.items():
            if url not in self._pollers:
                self._pollers[url] = asyncio.create_task(self._poll_loop(node))
        for url in [u for u in self._pollers if u not in self.nodes]:
            self._pollers.pop(url).cancel()

    async def _poll_loop(self, node: Node) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(node.wake.wait(), POLL_SECS)
            node.wake.clear()
            try:
                await self._poll(node)
            except Exception:  # never let a poller die
                log.exception("polling node %s failed", node.url)

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECS)
            if self.dns_name:
                try:
                    await self._discover()
                except Exception:
                    log.exception("finding the nodes in DNS failed")
                self._start_pollers()

    async def refresh(self) -> None:
        """Find the nodes (DNS) and poll each once, now."""
        if self.dns_name:
            await self._discover()
        await asyncio.gather(*(self._poll(n) for n in list(self.nodes.values())))

    async def refresh_one(self, node: Node) -> None:
        """Poll ``node`` now (it has just changed: a snapshot made or pulled)."""
        await self._poll(node)

    async def _discover(self) -> None:
        try:
            found = await asyncio.wait_for(
                asyncio.to_thread(self.resolver, self.dns_name or ""), RESOLVE_TIMEOUT_SECS
            )
        except (OSError, TimeoutError) as exc:
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
            was_up = node.up
            node.failures += 1
            node.error = str(exc) or type(exc).__name__
            if was_up and not node.up:
                log.warning("node %s is down: %s", node.name, node.error)
            return
        if not node.up:
            log.info("node %s is up", node.url)
        node.capacity = capacity if isinstance(capacity, dict) else {}
        node.node_id = str(node.capacity.get("node_id") or "") or None
        node.last_ok, node.error, node.failures = time.monotonic(), None, 0


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"
