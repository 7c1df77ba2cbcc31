"""The gateway's v1 API: the daemon's routes, each sent where it belongs.

| route | goes to |
|---|---|
| ``/v1/sandboxes/{id}...`` (HTTP and WebSocket) | the node the id names |
| ``POST /v1/sandboxes`` | placed (:mod:`.placement`), moved if needed, all or nothing |
| ``GET /v1/sandboxes``, ``/v1/snapshots``, ``/v1/volumes`` | every node up, merged |
| ``/v1/snapshots/{tag}...`` | the nodes holding it (``DELETE``: all of them) |
| ``POST /v1/snapshots`` | ``node`` if given, else the roomiest with its ``image``, or any |
| ``POST /v1/snapshots/pull``, ``POST /v1/volumes`` | ``node`` if given, else the roomiest |
| ``/v1/images...`` | :mod:`.image_routes` |
| ``/v1/volumes/{name}...`` | the node holding the volume |
| ``GET /v1/events`` | the sandbox's node, or every node merged |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from starlette.responses import JSONResponse, Response, StreamingResponse

from forkd import __version__, limits
from forkd.controller.http_errors import refuse_websocket, status_of
from forkd.errors import Conflict, Invalid, NotFound, Unavailable
from forkd.gateway.fleet_ops import FleetOps, passed_on
from forkd.gateway.image_placement import image_holders
from forkd.gateway.nodes import Node

log = logging.getLogger(__name__)
router = APIRouter()
MAX_EVENT_BYTES = 1 << 20  # one event of a node's stream, as the gateway merges them
ANY = ["GET", "POST", "PUT", "DELETE", "PATCH"]


def ops_of(request: Request | WebSocket) -> FleetOps:
    ops: FleetOps = request.app.state.ops  # Starlette's state holds Any
    return ops


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise Invalid(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise Invalid("the body must be a JSON object")
    return body


def roomiest(ops: FleetOps, pinned: Any) -> Node:
    if pinned is not None:
        return ops.node(str(pinned))
    up = ops.nodes.up()
    if not up:
        raise Unavailable("no node is up")
    return max(up, key=lambda n: (n.free(limits.DEFAULT_MEMORY_MIB), n.url))


# ------------------------------------------------------------------ discovery


@router.get("/healthz")
async def healthz() -> dict[str, bool]:
    return {"ok": True}


@router.get("/version")
async def version() -> dict[str, Any]:
    return {"version": __version__, "api": "v1", "gateway": True}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text: the nodes by state (each node's own /metrics has the rest)."""
    nodes = list(ops_of(request).nodes.nodes.values())
    up = sum(1 for n in nodes if n.up)
    lines = [
        "# HELP forkd_gateway_nodes Nodes behind this gateway, by state",
        "# TYPE forkd_gateway_nodes gauge",
        f'forkd_gateway_nodes{{state="up"}} {up}',
        f'forkd_gateway_nodes{{state="down"}} {len(nodes) - up}',
        "",
    ]
    return Response("\n".join(lines), media_type="text/plain; version=0.0.4")


@router.get("/v1/nodes")
async def nodes(request: Request) -> list[dict[str, Any]]:
    """Every node: its state, what it reported of its room, and its snapshots."""
    return [n.view() for n in ops_of(request).nodes.nodes.values()]


# ------------------------------------------------------------------ merged lists


async def merged(request: Request, path: str) -> list[Any]:
    merged: list[Any] = []
    for node, answer in await ops_of(request).ask_each(path, request.query_params.multi_items()):
        if answer.status_code != 200:
            raise Relayed(passed_on(answer))  # a bad filter: every node says the same
        merged += [{**item, "node": node.node_id} for item in answer.json()]
    return merged


class Relayed(Exception):
    """A node's own answer, to send as it is (the app's handler does)."""

    def __init__(self, response: Response) -> None:
        self.response = response


async def relayed(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Relayed)
    return exc.response


@router.get("/v1/sandboxes")
async def list_sandboxes(request: Request) -> Response:
    return JSONResponse(await merged(request, "/v1/sandboxes"))


@router.get("/v1/sandboxes/metrics")
async def list_sandbox_metrics(request: Request) -> Response:
    """Every node's sandboxes' figures, each with its node."""
    return JSONResponse(await merged(request, "/v1/sandboxes/metrics"))


@router.get("/v1/snapshots")
async def list_snapshots(request: Request) -> Response:
    """One entry per tag; ``nodes`` lists every node holding a snapshot of that tag."""
    items = await merged(request, "/v1/snapshots")
    by_tag: dict[str, dict[str, Any]] = {}
    for item in items:
        first = by_tag.setdefault(item["tag"], {**item, "nodes": []})
        first["nodes"].append(item.pop("node"))
    return JSONResponse(list(by_tag.values()))


@router.get("/v1/volumes")
async def list_volumes(request: Request) -> Response:
    return JSONResponse(await merged(request, "/v1/volumes"))


# ------------------------------------------------------------------ snapshots


async def _made_on_a_node(request: Request) -> Response:
    """A request that makes a snapshot: sent to ``node`` (from the body), else to the
    roomiest node holding its ``image``, else to the roomiest; that node is polled
    again at once, so it is known to hold the snapshot."""
    ops = ops_of(request)
    body = await _body(request)
    tag = body.get("tag")
    held = ops.nodes.holders(tag) if isinstance(tag, str) else []
    if held:  # one tag, one snapshot, across the nodes
        raise Conflict(f"snapshot {tag!r} already exists on node {held[0].name}")
    pinned, image = body.pop("node", None), body.get("image")
    node = roomiest(ops, pinned)
    if pinned is None and isinstance(image, str):
        node = next(iter(await image_holders(ops, image)), node)
    answer = await ops.forward.json(node, "POST", request.url.path, json=body, timeout=3600)
    if answer.status_code == 201:
        await ops.nodes.refresh_one(node)
    return passed_on(answer)


@router.post("/v1/snapshots")
async def create_snapshot(request: Request) -> Response:
    return await _made_on_a_node(request)


@router.post("/v1/snapshots/pull")
async def pull_snapshot(request: Request) -> Response:
    return await _made_on_a_node(request)


@router.delete("/v1/snapshots/{tag}")
async def delete_snapshot(request: Request, tag: str) -> Response:
    """Deleted on every node holding it; the first refusal is the answer."""
    ops = ops_of(request)
    holders = ops.nodes.holders(tag)
    if not holders:
        raise NotFound(f"snapshot {tag!r} not found on any node that is up")
    params = request.query_params.multi_items()
    for node in holders:
        answer = await ops.forward.json(node, "DELETE", f"/v1/snapshots/{tag}", params=params)
        if answer.status_code != 204:
            return passed_on(answer)
        with contextlib.suppress(ValueError):
            node.capacity.get("snapshots", []).remove(tag)
    return Response(status_code=204)


@router.api_route("/v1/snapshots/{tag}", methods=["GET"])
@router.api_route("/v1/snapshots/{tag}/{rest:path}", methods=ANY)
async def snapshot_route(request: Request, tag: str, rest: str = "") -> Response:
    ops = ops_of(request)
    holders = ops.nodes.holders(tag)
    if not holders:
        raise NotFound(f"snapshot {tag!r} not found on any node that is up")
    return await ops.forward.request(request, holders[0])


# ------------------------------------------------------------------ sandboxes


@router.post("/v1/sandboxes")
async def fork(request: Request) -> Response:
    return await ops_of(request).fork(await _body(request))


@router.api_route("/v1/sandboxes/{sandbox_id}", methods=ANY)
@router.api_route("/v1/sandboxes/{sandbox_id}/{rest:path}", methods=ANY)
async def sandbox_route(request: Request, sandbox_id: str, rest: str = "") -> Response:
    ops = ops_of(request)
    node = ops.owner(sandbox_id)
    answer = await ops.forward.request(request, node)
    if rest == "branch" and answer.status_code in (201, 202):
        await ops.nodes.refresh_one(node)  # it holds the branch now
    return answer


@router.websocket("/v1/sandboxes/{sandbox_id}/{rest:path}")
async def sandbox_socket(websocket: WebSocket, sandbox_id: str, rest: str) -> None:
    ops = ops_of(websocket)
    try:
        node = ops.owner(sandbox_id)
    except (NotFound, Unavailable) as exc:
        await refuse_websocket(
            websocket.scope, websocket.receive, websocket.send, status_of(exc), str(exc)
        )
        return
    await ops.forward.websocket(websocket, node)


# ------------------------------------------------------------------ volumes


@router.post("/v1/volumes")
async def create_volume(request: Request) -> Response:
    ops = ops_of(request)
    return await ops.forward.request(request, roomiest(ops, request.query_params.get("node")))


@router.api_route("/v1/volumes/{name}", methods=ANY)
@router.api_route("/v1/volumes/{name}/{rest:path}", methods=ANY)
async def volume_route(request: Request, name: str, rest: str = "") -> Response:
    ops = ops_of(request)
    for node in ops.nodes.up():
        answer = await ops.forward.json(node, "GET", f"/v1/volumes/{name}")
        if answer.status_code == 200:
            return await ops.forward.request(request, node)
    raise NotFound(f"volume {name!r} not found on any node that is up")


# ------------------------------------------------------------------ events


@router.get("/v1/events")
async def events(request: Request) -> Response:
    """One sandbox's events from its node (resumable); else every node's, merged (from now:
    ``since`` is per node and is not passed on)."""
    ops = ops_of(request)
    sandbox_id = request.query_params.get("sandbox_id")
    if sandbox_id:
        return await ops.forward.request(request, ops.owner(sandbox_id))
    params = tuple((k, v) for k, v in request.query_params.multi_items() if k != "since")
    client = ops.forward.client
    answers: list[Any] = []
    try:  # every node's stream open first: a filter one refuses is its answer, as it is
        for node in ops.nodes.up():
            upstream = client.build_request(
                "GET",
                f"{node.url}/v1/events",
                params=params,
                headers={"Accept": "text/event-stream"},
            )
            answer = await client.send(upstream, stream=True)
            answers.append(answer)
            if answer.status_code != 200:
                await answer.aread()
                return passed_on(answer)
    except Exception:
        await asyncio.gather(*(a.aclose() for a in answers), return_exceptions=True)
        raise
    return StreamingResponse(_merged_events(answers), media_type="text/event-stream")


async def _merged_events(answers: list[Any]) -> AsyncIterator[bytes]:
    """Each node's events as they come. When one node's stream ends (it stopped, or went
    away) the merged one ends too: the client reconnects, and gets every node up then."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1024)

    async def follow(answer: Any) -> None:
        pending = b""
        with contextlib.suppress(Exception):
            async for piece in answer.aiter_bytes():
                pending += piece
                while b"\n\n" in pending:
                    block, pending = pending.split(b"\n\n", 1)
                    await queue.put(block + b"\n\n")
                if len(pending) > MAX_EVENT_BYTES:  # not an event stream: the merge ends
                    log.warning(
                        "an event from %s is over %d bytes: the merged stream ends",
                        answer.url,
                        MAX_EVENT_BYTES,
                    )
                    break
        await queue.put(None)

    tasks = [asyncio.create_task(follow(a)) for a in answers]
    try:
        yield b": merged from every node\n\n"
        while (block := await queue.get()) is not None:
            yield block
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(a.aclose() for a in answers), return_exceptions=True)
