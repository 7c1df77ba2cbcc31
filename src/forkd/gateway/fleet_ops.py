"""What the gateway does across nodes: fork N children (placing them, and moving the
snapshot to a node that lacks it through the registry), and take a whole fork back
when one node's part of it fails."""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response

from forkd.errors import Conflict, Invalid, NotFound, Unavailable
from forkd.gateway import placement
from forkd.gateway.nodes import Node, NodeSet
from forkd.gateway.proxy import Forwarder, NodeUnreachable, error_text

log = logging.getLogger(__name__)

PULL_TIMEOUT = 1800.0  # a push and a pull of a big snapshot over a slow registry


@dataclass
class FleetOps:
    nodes: NodeSet
    forward: Forwarder
    registry: str | None = None  # where snapshots travel: registry/repository, no tag
    insecure_registry: bool = False
    _moving: dict[tuple[str, str], asyncio.Lock] = field(
        default_factory=lambda: collections.defaultdict(asyncio.Lock)
    )

    async def ask_each(self, path: str, params: Any = ()) -> list[tuple[Node, httpx.Response]]:
        """Every node up and its answer to ``GET path``; a node that fails to answer is
        left out (it is down meanwhile, as ``GET /v1/nodes`` shows)."""
        up = self.nodes.up()
        answers = await asyncio.gather(
            *(self.forward.json(n, "GET", path, params=params) for n in up),
            return_exceptions=True,
        )
        return [(n, a) for n, a in zip(up, answers, strict=True) if isinstance(a, httpx.Response)]

    def node(self, node_id: str) -> Node:
        node = self.nodes.by_id(node_id)
        if node is None:
            raise NotFound(f"no node {node_id!r}: see GET /v1/nodes")
        return node

    def owner(self, sandbox_id: str) -> Node:
        """The node a sandbox id names (``sb-<node id>-<n>``)."""
        parts = sandbox_id.split("-")
        if len(parts) < 3 or not parts[1]:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        node = self.nodes.by_id(parts[1])
        if node is None:
            raise Unavailable(
                f"sandbox {sandbox_id!r} belongs to node {parts[1]!r}, which is not up "
                "(or not one of this gateway's nodes)"
            )
        return node

    # ------------------------------------------------------------ fork

    async def fork(self, body: dict[str, Any]) -> Response:
        tag, n = body.get("snapshot_tag"), body.get("n", 1)
        pinned_id = body.pop("node", None)
        if not isinstance(tag, str) or not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return await self._ask_any("POST", "/v1/sandboxes", body)  # the daemon's 400
        pinned = self.node(str(pinned_id)) if pinned_id is not None else None
        holders = self.nodes.holders(tag)
        if not holders:
            raise NotFound(f"snapshot {tag!r} is on no node that is up")
        info = await self.forward.json(holders[0], "GET", f"/v1/snapshots/{tag}")
        if info.status_code != 200:
            return passed_on(info)
        memory_mib = int(info.json().get("memory_mib") or 0)  # what admission counts
        plan = placement.place(self.nodes.up(), holders, n, memory_mib, pinned)
        for target, _count in plan:
            if tag not in target.snapshots:
                await self.bring(tag, holders[0], target)
        answers = await asyncio.gather(
            *(
                self.forward.json(
                    node, "POST", "/v1/sandboxes", json={**body, "n": k}, timeout=PULL_TIMEOUT
                )
                for node, k in plan
            ),
            return_exceptions=True,
        )
        made: list[tuple[Node, dict[str, Any]]] = []
        failure: Response | None = None
        for (node, _k), answer in zip(plan, answers, strict=True):
            if isinstance(answer, BaseException):
                failure = failure or _unreachable(answer)
            elif answer.status_code != 201:
                failure = failure or passed_on(answer)
            else:
                made += [(node, sb) for sb in answer.json()]
        if failure is not None:  # all or nothing, as one daemon's fork is
            await asyncio.gather(*(self._kill(node, sb["id"]) for node, sb in made))
            return failure
        return JSONResponse([sb for _node, sb in made], status_code=201)

    async def _kill(self, node: Node, sandbox_id: str) -> None:
        try:
            await self.forward.json(node, "DELETE", f"/v1/sandboxes/{sandbox_id}")
        except NodeUnreachable:
            log.warning("could not kill %s on %s after a failed fork", sandbox_id, node.name)

    async def _ask_any(self, method: str, path: str, body: Any) -> Response:
        up = self.nodes.up()
        if not up:
            raise Unavailable("no node is up")
        return passed_on(await self.forward.json(up[0], method, path, json=body))

    # ------------------------------------------------------------ moving snapshots

    async def bring(self, tag: str, source: Node, target: Node) -> None:
        """Make ``target`` hold ``tag``: ``source`` pushes it, ``target`` pulls it."""
        async with self._moving[(tag, target.url)]:
            if tag in target.snapshots:
                return
            if not self.registry:
                raise Conflict(
                    f"node {target.name} lacks snapshot {tag!r} and the gateway has no "
                    "--registry to move it through"
                )
            ref = f"{self.registry}:{_ref_tag(source, tag)}"
            options = {"insecure": True} if self.insecure_registry else {}
            pushed = await self.forward.json(
                source,
                "POST",
                f"/v1/snapshots/{tag}/push",
                json={"ref": ref, **options},
                timeout=PULL_TIMEOUT,
            )
            if pushed.status_code != 200:
                raise Conflict(f"moving {tag!r} from {source.name}: push: {_error(pushed)}")
            exact = f"{self.registry}@{pushed.json()['digest']}"  # what was pushed, not newer
            pulled = await self.forward.json(
                target,
                "POST",
                "/v1/snapshots/pull",
                json={"ref": exact, "tag": tag, **options},
                timeout=PULL_TIMEOUT,
            )
            if pulled.status_code != 201 and "already exists" not in _error(pulled):
                raise Conflict(f"moving {tag!r} to {target.name}: pull: {_error(pulled)}")
            target.capacity.setdefault("snapshots", []).append(tag)
            log.info(
                "moved snapshot %s from %s to %s through %s",
                tag,
                source.name,
                target.name,
                self.registry,
            )


def _ref_tag(source: Node, tag: str) -> str:
    """The registry tag a snapshot travels under: its node's id, then its own tag."""
    text = f"{source.node_id}-{tag}"
    if len(text) > 128:
        raise Invalid(f"snapshot tag {tag!r} is too long to move through a registry")
    return text


def _error(answer: Any) -> str:
    """A node's ``{"error": ...}`` words; of any other answer, only its status."""
    return error_text(answer.text) or f"answered {answer.status_code}"


def passed_on(answer: Any) -> Response:
    return Response(
        answer.content,
        status_code=answer.status_code,
        media_type=answer.headers.get("content-type", "application/json"),
    )


def _unreachable(exc: BaseException) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=503)
