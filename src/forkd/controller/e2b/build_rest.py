"""E2B's template build API (``Template.build`` in its SDKs), which builds a forkd snapshot:

1. ``POST /v3/templates`` names the template (a forkd tag) and opens a build;
2. ``GET /templates/{id}/files/{hash}`` gives each COPY an upload link, which the SDK
   ``PUT``s a tar of the files to (a link this daemon signed: the link is the key);
3. ``POST /v2/templates/{id}/builds/{build}`` starts it. ``fromImage`` is forkd's template
   build of that container image (``POST /v1/snapshots``: imported, booted) with the
   steps run on the template before its snapshot; ``fromTemplate`` forks that template,
   runs the steps in the fork and branches it into the new one. Either way the result is
   an ordinary forkd snapshot, tagged with the template's name;
4. ``GET /templates/{id}/builds/{build}/status`` is polled for its state and log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from forkd.controller.bodies import receive_upload
from forkd.controller.e2b.build_models import BuildRequest, BuildStart
from forkd.controller.e2b.build_steps import StepFailed, StepRunner, check_steps
from forkd.controller.e2b.builds import FILES_HASH, Build, Builds
from forkd.controller.e2b.rest import Svc, services
from forkd.controller.http_errors import hide_host_paths
from forkd.controller.models import BranchRequest, SandboxCreate, SnapshotCreate
from forkd.controller.services import Services
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.errors import Conflict, ForkdError, Invalid
from forkd.limits import check_tag
from forkd.states import SandboxState

log = logging.getLogger(__name__)

build_rest = APIRouter()  # behind the API key
build_files = APIRouter()  # the signed upload links: no API key, the link is the key
UPLOADS = "/e2b-build-files/"
STATUS_PAGE = 100  # log entries in one status answer (E2B's)
DEFAULT_TAGS = ("default", "latest")  # E2B's tag of a name given without one
BUILD_SANDBOX_SECS = 4 * 3600.0  # a fromTemplate build's sandbox is killed by then
BUILD_LABEL = "e2b-build"  # a build's sandbox and template: its build id


def builds(request: Request) -> Builds:
    """The E2B port's builds, made at the first request that needs them."""
    found: Builds | None = getattr(request.app.state, "builds", None)
    if found is None:
        found = Builds.in_state_dir(services(request).settings, request.app.state.upload_limit)
        request.app.state.builds = found
    return found


HeldBuilds = Annotated[Builds, Depends(builds)]


def template_name(body: BuildRequest) -> str:
    """The forkd tag a build makes: E2B's name (``name`` or ``name:default``)."""
    given = body.name or body.alias
    if not given:
        raise Invalid("a template build needs a name")
    name, _, tag = given.partition(":")
    extra = [t for t in [tag, *(body.tags or [])] if t and t not in DEFAULT_TAGS]
    if extra:
        raise Invalid(
            f"template tags ({extra[0]!r}) are not served: a forkd template has one "
            "name (build 'name-v2' for another version)"
        )
    return check_tag(name)


@build_rest.post("/v3/templates", status_code=202)
async def request_build(body: BuildRequest, svc: Svc, held: HeldBuilds) -> Response:
    name = template_name(body)
    await _kill_orphans(svc, held)
    if svc.store.get_snapshot(name) is not None:
        raise Conflict(
            f"template {name!r} exists: delete it first (DELETE /templates/{name}, or "
            f"forkd snapshot rm {name})"
        )
    build = held.request(name, body.cpu_count, body.memory_mb)
    build.log(f"build {build.build_id} of template {name!r} requested")
    answer = {
        "templateID": name,
        "buildID": build.build_id,
        "public": False,
        "names": [name],
        "tags": ["default"],
        "aliases": [name],
    }
    return JSONResponse(answer, status_code=202)


@build_rest.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def upload_link(
    template_id: str, files_hash: str, request: Request, held: HeldBuilds
) -> Response:
    if not FILES_HASH.fullmatch(files_hash):
        raise Invalid("a files hash is 64 hex digits")
    build = held.latest(template_id)
    signature = held.signature(build.build_id, files_hash)
    base = str(request.base_url).rstrip("/")
    url = f"{base}{UPLOADS}{build.build_id}/{files_hash}?signature={signature}"
    return JSONResponse({"present": files_hash in build.files, "url": url}, status_code=201)


@build_files.put(UPLOADS + "{build_id}/{files_hash}")
async def upload(
    build_id: str,
    files_hash: str,
    request: Request,
    held: HeldBuilds,
    signature: Annotated[str, Query(max_length=128)] = "",
) -> Response:
    await receive_upload(request, lambda body: held.receive(build_id, files_hash, signature, body))
    return Response(status_code=200)


@build_rest.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(
    template_id: str, build_id: str, body: BuildStart, svc: Svc, held: HeldBuilds
) -> Response:
    build = held.get(template_id, build_id)
    if build.status != "waiting":
        raise Conflict(f"build {build_id!r} has started already")
    if bool(body.from_image) == bool(body.from_template):
        raise Invalid("a build starts from one of fromImage and fromTemplate")
    if body.from_image_registry is not None and body.from_image_registry.username:
        raise Invalid(
            "registry credentials per build are not taken: the daemon pulls with its "
            "own registry login (--registry-auth, docker's config.json)"
        )
    check_steps(body.steps)
    missing = [s for s in body.steps if s.type == "COPY" and s.files_hash not in build.files]
    if missing:
        raise Invalid(f"COPY {missing[0].arg(0)!r}: its files were not uploaded")
    if body.from_template is not None and svc.store.get_snapshot(body.from_template) is None:
        raise Invalid(f"no template {body.from_template!r} to build from")
    build.status = "building"
    build.task = asyncio.create_task(_build(svc, held, build, body))
    return Response(status_code=202)


@build_rest.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(
    template_id: str,
    build_id: str,
    held: HeldBuilds,
    logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
    limit: Annotated[int, Query(ge=0, le=STATUS_PAGE)] = STATUS_PAGE,
) -> Response:
    build = held.get(template_id, build_id)
    page = build.entries[logs_offset : logs_offset + limit]
    answer: dict[str, object] = {
        "templateID": template_id,
        "buildID": build_id,
        "status": build.status,
        "logEntries": page,
        "logs": [entry["message"] for entry in page],
    }
    if build.reason is not None:
        answer["reason"] = build.reason
    return JSONResponse(answer)


async def _kill_orphans(svc: Services, held: Builds) -> None:
    """Sandboxes of builds this daemon no longer holds (cut off by a restart) are killed:
    their builds ended with that run."""
    for info in svc.sandboxes.list():
        build_id = (info.metadata or {}).get(BUILD_LABEL)
        if build_id is not None and not held.holds(build_id) and info.state != SandboxState.DEAD:
            with contextlib.suppress(ForkdError):
                await svc.sandboxes.kill(info.id)


async def _build(svc: Services, held: Builds, build: Build, body: BuildStart) -> None:
    """The build, to its end: its status and log say how it went."""
    try:
        if body.from_template is not None:
            await _from_template(svc, build, body, held.upload_limit)
        else:
            await _from_image(svc, build, body, held.upload_limit)
        build.log(f"template {build.name!r} is ready")
        build.status = "ready"
    except StepFailed as exc:
        build.fail(hide_host_paths(str(exc)), exc.step)
    except ForkdError as exc:
        build.fail(hide_host_paths(str(exc)), "base")
    except asyncio.CancelledError:
        build.fail("the daemon stopped during the build", None)
        raise
    except Exception:
        error_id = uuid.uuid4().hex[:12]
        log.exception("E2B build %s failed (error id %s)", build.build_id, error_id)
        build.fail(f"the build failed inside the daemon (error id {error_id})", None)
    finally:
        held.finished(build)


async def _from_image(svc: Services, build: Build, body: BuildStart, inflate_limit: int) -> None:
    build.log(f"building from image {body.from_image}: importing and booting it", step="base")
    req = SnapshotCreate(
        tag=build.name,
        image=body.from_image,
        memory_mib=build.memory_mb,
        vcpus=build.cpu_count,
        metadata={BUILD_LABEL: build.build_id},
    )

    async def prepare(vm: SandboxVM) -> None:
        await StepRunner(vm, build, inflate_limit).run(body.steps, body.start_cmd, body.ready_cmd)
        build.log("taking the snapshot", step="finalize")

    await svc.snapshots.create(req, prepare=prepare)


async def _from_template(svc: Services, build: Build, body: BuildStart, inflate_limit: int) -> None:
    source = body.from_template or ""
    if build.memory_mb or build.cpu_count:
        build.log(f"the template keeps {source!r}'s memory and vCPUs", "warn", step="base")
    build.log(f"building from template {source!r}: forking it", step="base")
    made = SandboxCreate(
        snapshot_tag=source,
        timeout_s=BUILD_SANDBOX_SECS,
        metadata={BUILD_LABEL: build.build_id},
    )
    [info] = await svc.sandboxes.create(made)
    try:
        vm = svc.vms.live(info.id)
        await StepRunner(vm, build, inflate_limit).run(body.steps, body.start_cmd, body.ready_cmd)
        build.log("taking the snapshot (a branch of the build's sandbox)", step="finalize")
        await svc.branches.branch(info.id, BranchRequest(tag=build.name))
    finally:
        await svc.sandboxes.kill(info.id)
