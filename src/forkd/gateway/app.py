"""The gateway's ASGI app and its server: the daemon's auth and body limits, the routes of
:mod:`forkd.gateway.routes` and :mod:`forkd.gateway.image_routes`, the node poller for
the app's lifetime."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import Response

from forkd import __version__
from forkd.controller import http_errors
from forkd.controller.connection_limits import ConnectionLimiter, ConnectionLimits, uvicorn_options
from forkd.controller.middleware import GuardMiddleware
from forkd.controller.server import configure_logging, parse_bind
from forkd.gateway import image_routes, routes
from forkd.gateway.fleet_ops import FleetOps
from forkd.gateway.nodes import NodeSet
from forkd.gateway.proxy import MAX_MESSAGE_BYTES, WS_QUEUE, Forwarder, NodeUnreachable

log = logging.getLogger(__name__)


def create_app(
    nodes: NodeSet,
    token: str | None,
    registry: str | None = None,
    insecure_registry: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,  # tests: fake nodes
) -> FastAPI:
    forward = Forwarder(nodes, transport=transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await nodes.start()
        up = nodes.up()
        log.info("forkd gateway ready: %d of %d nodes up", len(up), len(nodes.nodes))
        try:
            yield
        finally:
            await forward.close()
            await nodes.close()

    app = FastAPI(title="forkd gateway", version=__version__, lifespan=lifespan)
    app.state.ops = FleetOps(nodes, forward, registry, insecure_registry)
    app.add_middleware(GuardMiddleware, token=token)
    http_errors.install(app)
    app.add_exception_handler(routes.Relayed, routes.relayed)
    app.add_exception_handler(NodeUnreachable, _unreachable)
    app.include_router(image_routes.router)
    app.include_router(routes.router)
    return app


async def _unreachable(_request: Request, exc: Exception) -> Response:
    return http_errors.error_response(503, str(exc))


def serve(
    app: FastAPI,
    bind: str,
    log_level: str = "info",
    connection_limits: ConnectionLimits | None = None,
    token: str | None = None,
) -> None:
    """Run the gateway until SIGTERM or SIGINT; clients' connections under the limits
    (the daemon's defaults when None), those that send ``token`` first."""
    configure_logging(log_level)
    connections = ConnectionLimiter(connection_limits or ConnectionLimits(), owner_token=token)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        ws_max_size=MAX_MESSAGE_BYTES,
        ws_max_queue=WS_QUEUE,
        timeout_graceful_shutdown=10,
        **uvicorn_options(connections),
        **parse_bind(bind),
    )
    uvicorn.Server(config).run()
