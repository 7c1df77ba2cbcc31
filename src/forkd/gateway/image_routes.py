"""The gateway's image routes. An image lives on the node that built, imported or was
sent it; a template is then made there (:mod:`.image_placement`).

| route | goes to |
|---|---|
| ``GET /v1/images`` | every node up, merged: each image with its ``node`` |
| ``GET /v1/images/{name}`` | the first node holding it, with ``nodes``: all that do |
| ``DELETE /v1/images/{name}`` | every node holding it, once none of them uses it |
| ``POST /v1/images``, ``/v1/images/load`` | ``?node=`` if given, else the roomiest |
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from forkd.errors import Conflict, NotFound
from forkd.gateway.fleet_ops import FleetOps, passed_on
from forkd.gateway.image_placement import is_build, listed_images
from forkd.gateway.nodes import Node
from forkd.gateway.routes import Relayed, merged, ops_of, roomiest

router = APIRouter()


@router.get("/v1/images")
async def list_images(request: Request) -> Response:
    return JSONResponse(await merged(request, "/v1/images"))


@router.post("/v1/images")
@router.post("/v1/images/load")
async def import_image(request: Request) -> Response:
    """Imported (or loaded: the archive streams through) on ``?node=``, else the roomiest;
    progress events stream back as the node sends them."""
    ops = ops_of(request)
    return await ops.forward.request(request, roomiest(ops, request.query_params.get("node")))


async def _held(ops: FleetOps, name: str) -> list[tuple[Node, dict[str, Any]]]:
    """Each node up holding image ``name``, with its ImageInfo; :class:`NotFound` when none
    does. A node's refusal of the name itself (a 400) is the answer, as it is."""
    path = f"/v1/images/{urllib.parse.quote(name, safe='')}"
    held: list[tuple[Node, dict[str, Any]]] = []
    for node, answer in await ops.ask_each(path):
        if answer.status_code == 200:
            held.append((node, answer.json()))
        elif answer.status_code != 404:
            raise Relayed(passed_on(answer))
    if not held:
        raise NotFound(f"image {name!r} not found on any node that is up")
    return held


@router.get("/v1/images/{name}")
async def image_info(request: Request, name: str) -> Response:
    held = await _held(ops_of(request), name)
    node, info = held[0]
    return JSONResponse({**info, "node": node.node_id, "nodes": [n.node_id for n, _ in held]})


@router.delete("/v1/images/{name}")
async def delete_image(request: Request, name: str) -> Response:
    """Deleted on every node holding it; refused (nothing deleted) while a snapshot or a
    VM on any of them boots from it."""
    ops = ops_of(request)
    held = await _held(ops, name)
    users = [
        f"{user} on node {node.node_id}"  # of every build a node's delete would take
        for node, infos in await listed_images(ops)
        for info in infos
        if is_build(info, name)
        for user in info.get("used_by") or []
    ]
    if users:
        raise Conflict(f"image {name!r} is in use: {', '.join(users)}; nothing was deleted")
    path = f"/v1/images/{urllib.parse.quote(name, safe='')}"
    for node, _ in held:
        answer = await ops.forward.json(node, "DELETE", path)
        if answer.status_code not in (204, 404):  # 404: gone meanwhile (or a shared cache)
            return passed_on(answer)
    return Response(status_code=204)
