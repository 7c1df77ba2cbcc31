"""``sandbox.get_host(port)``: E2B's SDKs name a sandbox's port as the host
``<port>-<sandbox id>.<domain>``, ``domain`` being what the sandbox's creation answered
(forkd's ``--e2b-domain``; by default ``localhost:<the E2B port>``, which curl and
browsers resolve to loopback by themselves). A request to the E2B port for such a host
is that guest port's, through the daemon's own port proxy (HTTP and WebSockets,
streamed, on an origin of its own): an app of the proxy's routes alone (:func:`proxy_app`),
so no other route of the daemon's can be reached this way, and no credential of the
daemon's is needed or passed on.

The same goes for a request to any port of the E2B port's that names the sandbox and a
guest port in E2B's routing headers (``E2b-Sandbox-Id``, ``E2b-Sandbox-Port``), other
than envd's and the code interpreter's.

It carries E2B's ``E2B-Traffic-Access-Token`` (or ``X-Access-Token``: both are the
sandbox's access token, which its SDK holds as ``sandbox.traffic_access_token``), as
E2B's private sandboxes ask; with ``--e2b-public-ports`` none is needed, as E2B's
sandboxes are public by default.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from forkd.controller import http_errors, port_proxy, port_ws
from forkd.controller.e2b.target import ENVD_PORT, INTERPRETER_PORT, live_row, sandbox_for
from forkd.controller.http_errors import error_response, refuse_websocket, status_of
from forkd.controller.middleware import AuditMiddleware
from forkd.controller.preview_hosts import AT_ROOT, OWN_ORIGIN
from forkd.controller.services import Services
from forkd.errors import ForkdError

TRAFFIC_HEADER = b"e2b-traffic-access-token"
# Either is the sandbox's access token: E2B's traffic token, or envd's.
CREDENTIALS = (TRAFFIC_HEADER, b"x-access-token")
SANDBOX_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,80}")


def proxy_app(audit: Callable[[Scope], Any]) -> FastAPI:
    """The daemon's port proxy routes (HTTP and WebSocket) and nothing else, audited as
    the daemon's own requests are."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.include_router(port_proxy.router)
    app.include_router(port_ws.router)
    http_errors.install(app)
    app.add_middleware(AuditMiddleware, audit=audit)
    return app


class GuestHosts:
    """ASGI middleware: a request for a guest's host goes to ``proxy`` (:func:`proxy_app`);
    any other passes to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        proxy: FastAPI,
        services: Callable[[], Services],
        domain: str,
        public: bool,
    ) -> None:
        self.app = app
        self.proxy = proxy
        self.services = services
        self.host = re.compile(
            rf"^([0-9]{{1,5}})-([a-z0-9][a-z0-9-]{{0,80}})\.{re.escape(domain.lower())}$"
        )
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self._guest(scope) if scope["type"] in ("http", "websocket") else None
        if found is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = found
        problem = self._refused(scope, sandbox_id)
        if problem is not None:
            status, message = problem
            if scope["type"] == "websocket":
                await refuse_websocket(scope, receive, send, status, message)
            else:
                await error_response(status, message)(scope, receive, send)
            return
        self.proxy.state.services = self.services()
        await self.proxy(self._to_proxy(scope, port, sandbox_id), receive, send)

    def _guest(self, scope: Scope) -> tuple[int, str] | None:
        """The guest port and sandbox a request is for: by its host, or (E2B's routing
        headers, as its SDKs send them to E2B_SANDBOX_URL) by ``E2b-Sandbox-Id`` and an
        ``E2b-Sandbox-Port`` that is neither envd's nor the code interpreter's."""
        headers = dict(scope["headers"])
        match = self.host.match(headers.get(b"host", b"").decode("latin-1").lower())
        if match is not None:
            return int(match.group(1)), match.group(2)
        port = headers.get(b"e2b-sandbox-port", b"").decode("latin-1")
        sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
        if not (port.isdigit() and SANDBOX_ID.fullmatch(sandbox_id)):
            return None
        if int(port) in (ENVD_PORT, INTERPRETER_PORT) or not 0 < int(port) < 65536:
            return None
        return int(port), sandbox_id

    def _refused(self, scope: Scope, sandbox_id: str) -> tuple[int, str] | None:
        """Why the request may not reach the sandbox's port (None: it may). A wrong
        token is answered as an unknown sandbox: no answer says which ids exist."""
        given = next((v for k, v in scope["headers"] if k in CREDENTIALS), None)
        token = None if given is None else given.decode("latin-1")
        try:
            if self.public:
                live_row(self.services(), sandbox_id)
            else:  # the token's own check, as envd's routes and RPCs have it
                sandbox_for(self.services(), sandbox_id, None, token)
        except ForkdError as exc:
            return status_of(exc), str(exc)
        return None

    def _to_proxy(self, scope: Scope, port: int, sandbox_id: str) -> Scope:
        """``scope`` as the port proxy route takes it: its path under the proxy's prefix,
        without the caller's credentials, and marked as on an origin of its own (no
        cookie confinement to the prefix)."""
        prefix = f"/v1/sandboxes/{sandbox_id}/ports/{port}"
        raw = scope.get("raw_path") or scope["path"].encode()
        dropped = {b"authorization", *CREDENTIALS}
        state = {**scope.get("state", {}), OWN_ORIGIN: True, AT_ROOT: True}
        return {
            **scope,
            "path": prefix + scope["path"],
            "raw_path": prefix.encode() + raw,
            "root_path": "",
            "headers": [(k, v) for k, v in scope["headers"] if k not in dropped],
            "state": state,
        }
