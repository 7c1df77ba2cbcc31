"""The HTTP API (v1, see docs/API.md): FastAPI routes over the Manager."""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forkd import __version__
from forkd.controller.audit import AuditLog
from forkd.controller.errors import ApiError
from forkd.controller.manager import Manager, Settings
from forkd.controller.metrics import Metrics
from forkd.controller.store import Store

log = logging.getLogger(__name__)

JSON_BODY_LIMIT = 1 << 20  # 1 MiB for JSON routes
FILE_BODY_LIMIT = 32 << 20  # raw file uploads (the agent's own cap)
TAG_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
PathQ = Annotated[str, Query(description="absolute path inside the sandbox")]


# ------------------------------------------------------------------ bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class VolumeAttach(_Body):
    name: str = Field(pattern=TAG_PATTERN)
    path: str = Field(min_length=2, max_length=256, pattern=r"^/[A-Za-z0-9_./-]+$")
    readonly: bool = False


class SnapshotCreate(_Body):
    tag: str = Field(pattern=TAG_PATTERN)
    image: str | None = None
    kernel: str | None = None
    rootfs: str | None = None
    # Unset fields take the image recipe's [template] defaults (then 512 MiB, 1 vCPU).
    memory_mib: int | None = Field(None, ge=128, le=65536)
    vcpus: int | None = Field(None, ge=1, le=64)
    setup: list[str] = Field(default_factory=list, max_length=100)
    warmup: str | None = None
    boot_wait_secs: float = Field(90, gt=0, le=3600)
    volumes: list[VolumeAttach] = Field(default_factory=list, max_length=8)


class SandboxCreate(_Body):
    snapshot_tag: str = Field(pattern=TAG_PATTERN)
    n: int = Field(1, ge=1, le=1000)
    memory_limit_mib: int | None = Field(None, ge=64, le=65536)
    per_child_netns: bool = False
    timeout_secs: float | None = Field(None, gt=0, le=30 * 86400)
    internet: bool | None = None


class ExecBody(_Body):
    args: list[str] = Field(min_length=1)
    timeout_secs: float = Field(30, gt=0, le=86400)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None


class EvalBody(_Body):
    code: str


class BranchBody(_Body):
    tag: str | None = Field(None, pattern=TAG_PATTERN)
    mode: str | None = None


# ------------------------------------------------------------- middleware


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class GuardMiddleware:
    """Bearer-token auth on every route but /healthz, and request body limits."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = {k.decode().lower(): v for k, v in scope["headers"]}
        if self.token is not None and path != "/healthz":
            given = headers.get("authorization", b"")
            expected = b"Bearer " + self.token
            if not hmac.compare_digest(given, expected):
                await _error(401, "missing or wrong bearer token")(scope, receive, send)
                return
        # Raw bodies: file uploads, and a volume's content as a tar archive.
        is_file_route = path.endswith("/files") or path == "/v1/volumes"
        limit = FILE_BODY_LIMIT if is_file_route else JSON_BODY_LIMIT
        if not is_file_route and scope["method"] in ("POST", "PUT", "PATCH"):
            # Bodies of the JSON routes are JSON whatever the client labelled
            # them (curl -d sends application/x-www-form-urlencoded).
            scope = dict(scope)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k.lower() != b"content-type"
            ] + [(b"content-type", b"application/json")]
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _error(413, f"request body over {limit} bytes")(scope, receive, send)
            return
        if length is not None or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # A chunked body (no Content-Length): read it here, within the limit,
        # then hand it to the app as one message.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                await _error(413, f"request body over {limit} bytes")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_ID_IN_PATH = re.compile(r"^/v1/(sandboxes|snapshots)/([^/]+)")


# ------------------------------------------------------------------- app


def create_app(settings: Settings, token: str | None = None) -> FastAPI:
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        store = Store(settings.state_dir / "forkd.db")
        manager_ref: list[Manager] = []
        metrics = Metrics(
            snapshots=lambda: len(store.list_snapshots()),
            sandboxes=lambda: len(manager_ref[0].vms) if manager_ref else 0,
            pooled=lambda: manager_ref[0].pool.waiting() if manager_ref else 0,
        )
        manager = Manager(settings, store, metrics)
        manager_ref.append(manager)
        state.update(
            store=store, manager=manager, metrics=metrics,
            audit=AuditLog(settings.state_dir / "audit.log"),
        )  # fmt: skip
        await manager.start()
        log.info("forkd ready: %d snapshots, %d sandboxes adopted",
                 len(store.list_snapshots()), len(manager.vms))  # fmt: skip
        try:
            yield
        finally:
            await manager.stop()
            state["audit"].close()
            store.close()

    app = FastAPI(title="forkd", version=__version__, lifespan=lifespan)
    app.add_middleware(GuardMiddleware, token=token)

    def mgr() -> Manager:
        return state["manager"]

    @app.middleware("http")
    async def audit(request: Request, call_next: Any) -> Response:
        started = time.monotonic()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            audit_log: AuditLog | None = state.get("audit")
            if audit_log is not None and request.url.path not in ("/healthz", "/metrics"):
                m = _ID_IN_PATH.match(request.url.path)
                audit_log.write(
                    method=request.method,
                    path=request.url.path,
                    status=status,
                    sandbox_id=m.group(2) if m and m.group(1) == "sandboxes" else None,
                    snapshot_tag=m.group(2) if m and m.group(1) == "snapshots" else None,
                    duration_ms=round((time.monotonic() - started) * 1000, 1),
                    client=request.client.host if request.client else None,
                )

    @app.exception_handler(ApiError)
    async def api_error(_r: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_r: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "invalid request: " + "; ".join(problems))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(_r: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    # -------------------------------------------------------- discovery

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__, "api": "v1"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].render(), media_type="text/plain; version=0.0.4")

    # -------------------------------------------------------- snapshots

    @app.post("/v1/snapshots", status_code=201)
    async def create_snapshot(body: SnapshotCreate) -> dict[str, Any]:
        return await mgr().create_snapshot(body.model_dump())

    @app.get("/v1/snapshots")
    async def list_snapshots() -> list[dict[str, Any]]:
        return mgr().list_snapshots()

    @app.get("/v1/snapshots/{tag}/info")
    async def snapshot_info(tag: str) -> dict[str, Any]:
        return mgr().snapshot_info(tag, detailed=True)

    @app.delete("/v1/snapshots/{tag}", status_code=204)
    async def delete_snapshot(tag: str) -> Response:
        await mgr().delete_snapshot(tag)
        return Response(status_code=204)

    # -------------------------------------------------------- sandboxes

    @app.post("/v1/sandboxes", status_code=201)
    async def spawn(body: SandboxCreate) -> list[dict[str, Any]]:
        return await mgr().spawn(body.model_dump())

    @app.get("/v1/sandboxes")
    async def list_sandboxes() -> list[dict[str, Any]]:
        return mgr().list_sandboxes()

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        return mgr().sandbox_info(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    async def kill_sandbox(sandbox_id: str) -> Response:
        await mgr().kill(sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/ping")
    async def ping(sandbox_id: str) -> dict[str, Any]:
        return await mgr().ping(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_(sandbox_id: str, body: ExecBody) -> dict[str, Any]:
        res = await mgr().exec(sandbox_id, body.model_dump())
        return {
            "stdout": res.get("stdout", ""),
            "stderr": res.get("stderr", ""),
            "exit_code": res.get("exit_code"),
            "timed_out": res.get("timed_out", False),
            "stdout_truncated": res.get("stdout_truncated", False),
            "stderr_truncated": res.get("stderr_truncated", False),
            "duration_ms": res.get("duration_ms"),
        }

    @app.post("/v1/sandboxes/{sandbox_id}/eval")
    async def eval_(sandbox_id: str, body: EvalBody) -> dict[str, Any]:
        res = await mgr().eval(sandbox_id, body.code)
        return {
            "result": res.get("result"),
            "error": res.get("error"),
            "exit_code": res.get("exit_code", 0),
            "stdout": res.get("stdout", ""),
            "stderr": res.get("stderr", ""),
        }

    @app.post("/v1/sandboxes/{sandbox_id}/branch", status_code=201)
    async def branch(sandbox_id: str, body: BranchBody | None = None) -> dict[str, Any]:
        body = body or BranchBody()
        return await mgr().branch(sandbox_id, body.tag, body.mode)

    # -------------------------------------------------------- volumes

    @app.get("/v1/volumes")
    async def list_volumes() -> list[dict[str, Any]]:
        return mgr().list_volumes()

    @app.post("/v1/volumes", status_code=201)
    async def create_volume(
        request: Request,
        name: Annotated[str, Query(pattern=TAG_PATTERN)],
        size: Annotated[str, Query(max_length=32)] = "1G",
    ) -> dict[str, Any]:
        """An ext4 volume of ``size``; a tar archive as the body fills it."""
        return await mgr().create_volume(name, size, await request.body())

    @app.get("/v1/volumes/{name}")
    async def volume_info(name: str) -> dict[str, Any]:
        return mgr().volume_info(name)

    @app.delete("/v1/volumes/{name}", status_code=204)
    async def delete_volume(name: str) -> Response:
        await mgr().delete_volume(name)
        return Response(status_code=204)

    # -------------------------------------------------------- files

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: PathQ) -> Response:
        data = await mgr().read_file(sandbox_id, path)
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def write_file(sandbox_id: str, path: PathQ, request: Request) -> dict[str, Any]:
        data = await request.body()
        size = await mgr().write_file(sandbox_id, path, data)
        return {"path": path, "size": size}

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove_file(sandbox_id: str, path: PathQ, recursive: bool = False) -> Response:
        await mgr().remove_file(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_files(sandbox_id: str, path: PathQ) -> list[dict[str, Any]]:
        return await mgr().list_files(sandbox_id, path)

    return app
