"""``sandbox.get_host(port)``: E2B's SDKs name a sandbox's port as the host
``<port>-<sandbox id>.<domain>``, ``domain`` being what the sandbox's creation answered
(forkd's ``--e2b-domain``; by default ``localhost:<the E2B port>``, which curl and
browsers resolve to loopback by themselves). A request to the E2B port for such a host
is that guest port's, through the daemon's own port proxy (HTTP and WebSockets,
streamed, on an origin of its own).

It carries E2B's ``E2B-Traffic-Access-Token`` (the sandbox's access token, which its
SDK holds as ``sandbox.traffic_access_token``), as E2B's private sandboxes ask; with
``--e2b-public-ports`` none is needed, as E2B's sandboxes are public by default.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from forkd.controller.http_errors import error_response, refuse_websocket
from forkd.controller.preview_hosts import AT_ROOT, OWN_ORIGIN
from forkd.controller.services import Services
from forkd.errors import ForkdError
from forkd.states import SandboxState

TRAFFIC_HEADER = b"e2b-traffic-access-token"


class GuestHosts:
    """ASGI middleware: a request for a guest's host goes to the daemon's port proxy
    (``daemon``), with the daemon's own credentials; any other passes to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        daemon: ASGIApp,
        services: Callable[[], Services],
        domain: str,
        token: str | None,
        public: bool,
    ) -> None:
        self.app = app
        self.daemon = daemon
        self.services = services
        self.host = re.compile(
            rf"^([0-9]{{1,5}})-([a-z0-9][a-z0-9-]{{0,80}})\.{re.escape(domain.lower())}$"
        )
        self.bearer = f"Bearer {token}".encode() if token else None
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
        await self.daemon(self._to_proxy(scope, port, sandbox_id), receive, send)

    def _guest(self, scope: Scope) -> tuple[int, str] | None:
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        match = self.host.match(host.decode("latin-1").lower())
        if match is None:
            return None
        return int(match.group(1)), match.group(2)

    def _refused(self, scope: Scope, sandbox_id: str) -> tuple[int, str] | None:
        """Why the request may not reach the sandbox's port (None: it may)."""
        try:
            svc = self.services()
        except ForkdError as exc:
            return 503, str(exc)
        row = svc.store.get_sandbox(sandbox_id)
        if row is None or row.state == SandboxState.DEAD:
            return 502, f"sandbox {sandbox_id!r} was not found"
        if self.public:
            return None
        given = next((v for k, v in scope["headers"] if k == TRAFFIC_HEADER), None)
        if given is None:
            return 401, "no E2B-Traffic-Access-Token: the sandbox's traffic_access_token"
        want = svc.ports.key.access_token(sandbox_id, row.created_at_unix).encode()
        if not hmac.compare_digest(want, given):
            return 403, "that E2B-Traffic-Access-Token is not this sandbox's"
        return None

    def _to_proxy(self, scope: Scope, port: int, sandbox_id: str) -> Scope:
        """``scope`` as the daemon's port proxy route takes it: its path under the
        proxy's prefix, the daemon's bearer in place of the caller's credentials, and
        marked as on an origin of its own (no cookie confinement to the prefix)."""
        prefix = f"/v1/sandboxes/{sandbox_id}/ports/{port}"
        raw = scope.get("raw_path") or scope["path"].encode()
        dropped = {b"authorization", TRAFFIC_HEADER}
        headers = [(k, v) for k, v in scope["headers"] if k not in dropped]
        if self.bearer is not None:
            headers.append((b"authorization", self.bearer))
        state = {**scope.get("state", {}), OWN_ORIGIN: True, AT_ROOT: True}
        return {
            **scope,
            "path": prefix + scope["path"],
            "raw_path": prefix.encode() + raw,
            "root_path": "",
            "headers": headers,
            "state": state,
        }
