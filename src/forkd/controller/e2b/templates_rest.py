"""E2B's templates, which are forkd's snapshots: ``GET /templates`` lists them,
``GET /templates/{id}`` describes one, ``GET /templates/aliases/{alias}`` says whether a
name is one (E2B's ``Template.exists``). A template's id, alias and name are its tag;
its one build is the snapshot itself. Building a template from a Dockerfile through E2B's
build API is not served yet (forkd's own ``forkd image build`` and ``POST /v1/snapshots``
do it)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.models import ENVD_VERSION
from forkd.controller.e2b.rest import Svc, machine
from forkd.controller.models import SnapshotInfo
from forkd.errors import NotFound

templates_rest = APIRouter()
DISK_MB = 0  # forkd's snapshots have no fixed disk size to report


def _build_id(info: SnapshotInfo) -> str:
    """A stable UUID for the snapshot (E2B's builds are UUIDs)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"forkd-snapshot:{info.tag}:{info.created_at_unix}"))


def _status(info: SnapshotInfo) -> str:
    return {"ready": "ready", "writing": "building"}.get(info.status, "error")


def _template(svc: Svc, info: SnapshotInfo) -> dict[str, object]:
    cpus, memory = machine(svc, info.tag)
    made = datetime.fromtimestamp(info.created_at_unix, tz=UTC).isoformat()
    return {
        "templateID": info.tag,
        "buildID": _build_id(info),
        "cpuCount": cpus,
        "memoryMB": memory,
        "diskSizeMB": DISK_MB,
        "public": False,
        "aliases": [info.tag],
        "names": [info.tag],
        "createdAt": made,
        "updatedAt": made,
        "createdBy": None,
        "lastSpawnedAt": None,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": ENVD_VERSION,
        "buildStatus": _status(info),
    }


def _found(svc: Svc, tag: str) -> SnapshotInfo:
    """The template ``tag``: 404 for any name that is none (one forkd could not tag
    with too: E2B's SDK reads 404 as "no such template")."""
    if svc.store.get_snapshot(tag) is None:
        raise NotFound(f"no template {tag!r}")
    return svc.snapshots.info(tag)


@templates_rest.get("/templates")
async def list_templates(svc: Svc) -> Response:
    return JSONResponse([_template(svc, info) for info in svc.snapshots.list()])


@templates_rest.get("/templates/aliases/{alias}")
async def alias(alias: str, svc: Svc) -> Response:
    info = _found(svc, alias)
    return JSONResponse({"templateID": info.tag, "public": False})


@templates_rest.get("/templates/{template_id}")
async def get_template(template_id: str, svc: Svc) -> Response:
    info = _found(svc, template_id)
    described = _template(svc, info)
    build = {
        "buildID": described["buildID"],
        "status": described["buildStatus"],
        "createdAt": described["createdAt"],
        "updatedAt": described["updatedAt"],
        "cpuCount": described["cpuCount"],
        "memoryMB": described["memoryMB"],
        "diskSizeMB": DISK_MB,
        "envdVersion": ENVD_VERSION,
    }
    return JSONResponse({**described, "builds": [build]})
