"""The HTTP API's JSON routes, written once for the sync and the async client.

Each method of :class:`Routes` builds a :class:`Call`: the request and what to
make of its answer. It never sends one itself. The :func:`route` decorator hands
the call to the client it is read from: the sync :class:`~forkd.client.Controller`
sends it and returns the answer, the async :class:`~forkd.client.AsyncController`
returns an awaitable of it. So both clients speak the same wire format from the
same code, and the type checker knows ``ctl.health()`` is a ``JSONDict`` on one
and an ``Awaitable[JSONDict]`` on the other. (The streaming routes, with bodies
that are iterated, live in their own modules.)
"""

from __future__ import annotations

from forkd.client.connection import JSONDict
from forkd.client.file_routes import FileCalls
from forkd.client.image_routes import ImageCalls
from forkd.client.port_routes import PortCalls
from forkd.client.process_routes import ProcessCalls
from forkd.client.route_base import (
    EVAL_HTTP_MARGIN_SECS,
    KEEP,
    AsyncRunner,
    Call,
    SyncRunner,
    route,
)
from forkd.client.sandbox_routes import SandboxCalls
from forkd.client.secret_routes import SecretCalls
from forkd.client.snapshot_routes import SnapshotCalls
from forkd.client.volume_routes import VolumeCalls
from forkd.client.webhook_routes import WebhookCalls
from forkd.client.workspace_routes import WorkspaceCalls


class Routes(
    SnapshotCalls,
    VolumeCalls,
    SecretCalls,
    WebhookCalls,
    ImageCalls,
    SandboxCalls,
    WorkspaceCalls,
    FileCalls,
    ProcessCalls,
    PortCalls,
):
    """The JSON routes, one mixin per resource (each in its module), and discovery."""

    # -- discovery ----------------------------------------------------------

    @route
    def health(self) -> Call[JSONDict]:
        """``GET /healthz`` → ``{"ok": true}`` (needs no token)."""
        return self._json("GET", "/healthz")

    @route
    def version(self) -> Call[JSONDict]:
        """``GET /version`` → ``{"version": "...", "api": "v1"}``."""
        return self._json("GET", "/version")


__all__ = ["EVAL_HTTP_MARGIN_SECS", "KEEP", "AsyncRunner", "Call", "Routes", "SyncRunner", "route"]
