"""The daemon's FastAPI application: lifespan, middleware, error handlers, routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from forkd import __version__, limits, paths
from forkd.controller import (
    console,
    http_errors,
    port_proxy,
    port_ws,
    pty_ws,
    routes,
)
from forkd.controller.audit import AuditLog
from forkd.controller.connection_limits import ConnectionLimiter
from forkd.controller.metrics import Metrics
from forkd.controller.middleware import AuditMiddleware, GuardMiddleware, SandboxRequests
from forkd.controller.preview_hosts import PreviewHosts
from forkd.controller.services import Services
from forkd.controller.services.images import Importer
from forkd.controller.services.launcher import VMDriver
from forkd.controller.settings import Settings
from forkd.controller.store import Store

if TYPE_CHECKING:
    from forkd.controller.otel.telemetry import Telemetry

log = logging.getLogger(__name__)

EXPLORE_DRAIN_SECS = 30.0  # explores being taken back when the daemon stops
WAKE_DRAIN_SECS = 30.0  # wakes under way when the daemon stops


async def _stop(services: Services) -> None:
    """The daemon's background work ends, what it wrote is flushed, its proxy closed."""
    services.events.close()
    await services.webhooks.deliverer.stop()  # what is not sent yet goes at the next start
    await services.explore.drain(EXPLORE_DRAIN_SECS)  # cancelled ones taken back
    await services.reclaim.stop()
    await services.waker.drain(WAKE_DRAIN_SECS)
    await services.usage.stop()
    await services.lifecycle.stop()
    await asyncio.to_thread(services.shared_volumes.stop)
    services.secrets.flush_uses(force=True)
    await services.egress.proxy.close()


def create_app(
    settings: Settings,
    token: str | None = None,
    driver: VMDriver | None = None,
    connections: ConnectionLimiter | None = None,
    importer: Importer | None = None,
) -> FastAPI:
    """The app of one daemon. ``driver`` replaces the QEMU VM driver and ``importer``
    the container image importer (tests only); ``connections``, the server's count
    of client connections, is shown in /metrics."""

    telemetry = _telemetry(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(settings.state_dir / "forkd.db")
        holder: list[Services] = []
        metrics = _metrics(settings, store, holder, connections)
        services = Services.create(settings, store, metrics, driver, importer)
        holder.append(services)
        if telemetry is not None:
            telemetry.start(metrics)
        await _start(app, settings, services, metrics)
        log.info(
            "forkd ready: %d snapshots, %d sandboxes adopted",
            len(store.list_snapshots()),
            len(services.vms),
        )
        try:
            yield
        finally:
            await _stop(services)
            if telemetry is not None:  # the last spans and metrics sent (a few seconds at most)
                await telemetry.stop()
            _close_audit(app, services)
            store.close()

    app = FastAPI(title="forkd", version=__version__, lifespan=lifespan)
    _add_middleware(app, settings, token)
    http_errors.install(app)
    http_errors.hide_paths_under(
        [settings.state_dir, settings.snapshot_root, settings.run_dir, paths.cache_dir()]
    )
    _add_routes(app)
    app.state.telemetry = telemetry
    if telemetry is not None:
        telemetry.instrument(app)
    return app


def _telemetry(settings: Settings) -> Telemetry | None:
    """The daemon's OpenTelemetry export, if ``--otlp-endpoint`` asks for it: only then
    is OpenTelemetry imported."""
    if settings.otlp_endpoint is None:
        return None
    from forkd.controller.otel.telemetry import Telemetry

    return Telemetry(settings.otlp_endpoint)


def _metrics(
    settings: Settings,
    store: Store,
    holder: list[Services],
    connections: ConnectionLimiter | None,
) -> Metrics:
    """The daemon's metrics, read from its services once ``holder`` holds them."""
    return Metrics(
        snapshots=lambda: len(store.list_snapshots()),
        sandboxes=lambda: len(holder[0].vms) if holder else 0,
        pooled=lambda: holder[0].pool.waiting() if holder else 0,
        branches_in_flight=lambda: holder[0].branches.in_flight if holder else 0,
        branch_cap=lambda: settings.branch_concurrency,
        connections=connections.counts if connections is not None else None,
    )


async def _start(app: FastAPI, settings: Settings, services: Services, metrics: Metrics) -> None:
    """The app's state, the audit log its services write to, and their background work
    started (the VMs a previous daemon left adopted)."""
    app.state.services = services
    app.state.metrics = metrics
    app.state.audit = AuditLog(settings.state_dir / "audit.log")
    services.expiry.audit = app.state.audit.write
    services.reclaim.audit = app.state.audit.write
    services.egress.report.refusals.write = app.state.audit.write
    services.secrets.start()
    # Before the sandboxes left running are adopted: the volumes they mount are mounted.
    await asyncio.to_thread(services.shared_volumes.start)
    await services.lifecycle.start()
    services.webhooks.deliverer.start()
    services.reclaim.start()
    services.usage.start()
    metrics.watch_sandboxes(services.usage.all, limits.SANDBOX_SERIES_CAP)
    metrics.watch_egress(lambda: services.egress.proxy.log.counts, limits.SANDBOX_SERIES_CAP)


def _close_audit(app: FastAPI, services: Services) -> None:
    """The daemon has stopped: nothing writes to the audit log any more, and it is closed."""
    services.expiry.audit = None
    services.reclaim.audit = None
    services.egress.report.refusals.write = None
    app.state.audit.close()
    app.state.audit = None


def _add_middleware(app: FastAPI, settings: Settings, token: str | None) -> None:
    app.add_middleware(SandboxRequests)  # innermost: sandboxes in use, wakes in a header
    # Added last, the audit log is outermost: it records 401s and 413s too.
    app.add_middleware(
        GuardMiddleware,
        token=token,
        upload_limit=settings.max_upload_bytes,
        image_limit=settings.max_image_bytes,
    )
    app.add_middleware(PreviewHosts, domain=settings.preview_domain)
    app.add_middleware(AuditMiddleware)


def _add_routes(app: FastAPI) -> None:
    for router in routes.ROUTERS:
        app.include_router(router)
    app.include_router(pty_ws.router)  # a WebSocket: not in the OpenAPI document
    app.include_router(port_proxy.router)  # the guest's answers: not in the document
    app.include_router(port_ws.router)
    app.include_router(console.router)  # the web console's static files (/ui)


def end_streams(app: FastAPI) -> None:
    """The daemon stops: end its event streams, which end on nothing else. The server
    calls this before it waits for open connections (and only then runs the lifespan's
    end), so an open stream does not hold the daemon up."""
    services = getattr(app.state, "services", None)
    if services is not None:
        services.events.close()
