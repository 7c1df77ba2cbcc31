"""The routes of secrets (``/v1/secrets``): write-only credentials for the egress
proxy (docs/API.md, Secrets)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from forkd import limits
from forkd.controller.egress_models import SecretCreate, SecretInfo, SecretUpdate
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.routes import NO_CONTENT, Svc

secrets = APIRouter(prefix="/v1/secrets", tags=["secrets"], responses=ERROR_RESPONSES)
SecretNameP = Annotated[str, Path(pattern=limits.SECRET_NAME_PATTERN)]


@secrets.get("", response_model=list[SecretInfo])
async def list_secrets(svc: Svc) -> list[SecretInfo]:
    """Every secret's name and hosts, by name; never a value."""
    return svc.secrets.list()


@secrets.post("", status_code=201, response_model=SecretInfo)
async def create_secret(svc: Svc, body: SecretCreate) -> SecretInfo:
    """A secret: sealed at rest, sent only to its hosts, by the egress proxy, in place of
    ``${secrets.NAME}`` in a request's headers. 409 if the name is taken."""
    return svc.secrets.create(body)


@secrets.get("/{name}", response_model=SecretInfo)
async def secret_info(svc: Svc, name: SecretNameP) -> SecretInfo:
    return svc.secrets.info(name)


@secrets.put("/{name}", response_model=SecretInfo)
async def update_secret(svc: Svc, name: SecretNameP, body: SecretUpdate) -> SecretInfo:
    """Rotate the value and/or change the hosts: the next request uses them; no sandbox
    restarts."""
    return svc.secrets.update(name, body)


@secrets.delete("/{name}", **NO_CONTENT)
async def delete_secret(
    svc: Svc,
    name: SecretNameP,
    force: Annotated[
        bool, Query(description="even while running sandboxes' network rules name it")
    ] = False,
) -> Response:
    """409 while a running sandbox's network rules name it, unless ``force``."""
    svc.secrets.delete(name, force)
    return Response(status_code=204)


ROUTERS = (secrets,)
