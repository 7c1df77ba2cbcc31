"""E2B's volumes (``POST/GET /volumes``, ``GET/DELETE /volumes/{id}``): forkd's shared
volumes (:mod:`forkd.controller.services.shared_volumes`), which a sandbox mounts at
create (``volumeMounts``) and every sandbox mounting one reads and writes at once.

A volume's token (for E2B's content API, ``/volumecontent``) is keyed to the volume.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.models import Body
from forkd.controller.e2b.rest import Svc
from forkd.controller.services import Services
from forkd.controller.services.shared_volumes import SharedVolume

volumes_rest = APIRouter()


class NewVolume(Body):
    name: str


def _with_token(svc: Services, volume: SharedVolume) -> dict[str, str]:
    token = svc.ports.key.volume_token(volume.id, volume.created_at_unix)
    return {"volumeID": volume.id, "name": volume.name, "token": token}


@volumes_rest.post("/volumes", status_code=201)
async def create_volume(body: NewVolume, svc: Svc) -> Response:
    volume = await svc.shared_volumes.create(body.name)
    return JSONResponse(_with_token(svc, volume), status_code=201)


@volumes_rest.get("/volumes")
async def list_volumes(svc: Svc) -> Response:
    listed = [{"volumeID": v.id, "name": v.name} for v in svc.shared_volumes.all()]
    return JSONResponse(listed)


@volumes_rest.get("/volumes/{volume_id}")
async def get_volume(volume_id: str, svc: Svc) -> Response:
    return JSONResponse(_with_token(svc, svc.shared_volumes.get(volume_id)))


@volumes_rest.delete("/volumes/{volume_id}", status_code=204)
async def delete_volume(volume_id: str, svc: Svc) -> Response:
    await svc.shared_volumes.delete(volume_id)
    return Response(status_code=204)
