"""The E2B port's application: E2B's REST API and, at the root, a sandbox's in-guest
daemon, over the services of the daemon ``daemon`` (the app ``forkd serve`` runs on
its own port). Errors answer as E2B's do (``{"code", "message"}``), so its SDKs raise
their own exceptions (NotFoundException, AuthenticationException, ...)."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, FastAPI, Header
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Scope

from forkd import __version__, limits
from forkd.controller import http_errors
from forkd.controller.e2b.auth import check_api_key
from forkd.controller.e2b.build_rest import UPLOADS, build_files, build_rest
from forkd.controller.e2b.builds import Builds
from forkd.controller.e2b.envd import envd
from forkd.controller.e2b.filesystem_rpc import filesystem_app
from forkd.controller.e2b.guest_hosts import GuestHosts, proxy_app
from forkd.controller.e2b.interpreter import interpreter
from forkd.controller.e2b.logs_rest import logs_rest
from forkd.controller.e2b.metrics_rest import metrics_rest
from forkd.controller.e2b.process_rpc import process_app
from forkd.controller.e2b.rest import daemon_services, rest
from forkd.controller.e2b.secrets_rest import secrets_rest
from forkd.controller.e2b.snapshots_rest import snapshots_rest
from forkd.controller.e2b.templates_rest import templates_rest
from forkd.controller.e2b.volume_content import volume_content
from forkd.controller.e2b.volumes_rest import volumes_rest
from forkd.controller.http_errors import hide_host_paths
from forkd.controller.middleware import AuditMiddleware, GuardMiddleware


def create_e2b_app(
    daemon: FastAPI,
    token: str | None,
    upload_limit: int,
    *,
    domain: str | None = None,
    public_ports: bool = False,
    builds: Builds | None = None,
) -> FastAPI:
    """``token``: the daemon's bearer token, E2B's API key here (None: no auth);
    ``upload_limit``: the most one file upload may send, as on the daemon's port;
    ``domain``: sandbox ports are served for hosts ``<port>-<id>.<domain>``
    (:mod:`.guest_hosts`), without E2B's traffic token when ``public_ports``;
    ``builds``: where template builds keep their uploads (made at start, which empties
    what an earlier run left)."""

    def api_key(x_api_key: Annotated[str | None, Header(alias="X-API-KEY")] = None) -> None:
        check_api_key(x_api_key, token)

    app = FastAPI(title="forkd: E2B's API", version=__version__, openapi_url=None)
    app.state.daemon = daemon
    app.state.upload_limit = upload_limit
    if builds is not None:  # else made at the first build (build_rest.builds)
        app.state.builds = builds
    app.include_router(rest, dependencies=[Depends(api_key)])
    app.include_router(snapshots_rest, dependencies=[Depends(api_key)])
    app.include_router(metrics_rest, dependencies=[Depends(api_key)])
    app.include_router(logs_rest, dependencies=[Depends(api_key)])
    app.include_router(templates_rest, dependencies=[Depends(api_key)])
    app.include_router(secrets_rest, dependencies=[Depends(api_key)])
    app.include_router(volumes_rest, dependencies=[Depends(api_key)])
    app.include_router(volume_content)  # the volume's own token (Authorization: Bearer)
    app.include_router(build_rest, dependencies=[Depends(api_key)])
    app.include_router(build_files)
    app.include_router(envd)
    app.include_router(interpreter)
    for rpc in (process_app, filesystem_app):
        served = rpc(lambda: daemon_services(daemon), limits.JSON_BODY_LIMIT)
        # connectrpc types its apps with asgiref's ASGI types, Starlette with its own
        app.mount(served.path, cast(ASGIApp, served))
    app.add_middleware(
        GuardMiddleware, token=None, upload_limit=upload_limit, uploads=_upload, typed=_typed
    )
    app.add_middleware(
        AuditMiddleware,
        audit=lambda _scope: getattr(daemon.state, "audit", None),
        respond=e2b_error,
    )
    _install_errors(app)
    if domain is not None:
        app.state.e2b_domain = domain
        app.add_middleware(
            GuestHosts,
            proxy=proxy_app(audit=lambda _scope: getattr(daemon.state, "audit", None)),
            services=lambda: daemon_services(daemon),
            domain=domain,
            public=public_ports,
        )
    return app


STREAMED = ("/files", "/process.Process/StreamInput")  # bodies that stream in
CONNECT_SERVICES = ("/process.Process/", "/filesystem.Filesystem/")


def _upload(scope: Scope) -> bool:
    if scope["method"] == "PUT" and str(scope["path"]).startswith(UPLOADS):
        return True  # a template build's files (build_rest)
    if scope["method"] == "PUT" and _volume_file(str(scope["path"])):
        return True  # a file written into a volume (volume_content)
    return bool(scope["method"] == "POST" and scope["path"] in STREAMED)


def _volume_file(path: str) -> bool:
    return path.startswith("/volumecontent/") and path.endswith("/file")


def _typed(scope: Scope) -> bool:
    """envd's Connect services read the body's Content-Type (JSON or binary protobuf)."""
    return _upload(scope) or str(scope["path"]).startswith(CONNECT_SERVICES)


def e2b_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": hide_host_paths(message)}, status_code=status)


def _install_errors(app: FastAPI) -> None:
    http_errors.install(app, respond=e2b_error)  # Unauthorized is its 401 there
