"""Discovery: health, version, capacity and the metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from forkd import __version__
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models import CapacityInfo, Health, VersionInfo
from forkd.controller.routes.common import Svc

discovery = APIRouter(tags=["discovery"])


@discovery.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(ok=True)


@discovery.get("/version", response_model=VersionInfo)
async def version() -> VersionInfo:
    return VersionInfo(version=__version__, api="v1")


@discovery.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
)
async def metrics(request: Request) -> Response:
    body = request.app.state.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4")


@discovery.get("/v1/capacity", response_model=CapacityInfo, responses=ERROR_RESPONSES)
async def capacity(svc: Svc) -> CapacityInfo:
    """Room left for sandboxes, and the snapshots held: what a gateway places by."""
    return svc.capacity.info()
