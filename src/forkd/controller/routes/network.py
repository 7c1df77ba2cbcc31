"""The routes of secrets (``/v1/secrets``): write-only credentials for the egress
proxy (docs/API.md, Secrets)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from forkd import limits
from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models.network import (
    EgressPage,
    NetworkInfo,
    NetworkPolicy,
    SecretCreate,
    SecretInfo,
    SecretUpdate,
)
from forkd.controller.routes.common import NO_CONTENT, Svc

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
    svc.secrets.delete(name, named_by=svc.network.rules_naming(name), force=force)
    return Response(status_code=204)


network = APIRouter(prefix="/v1/sandboxes", tags=["network"], responses=ERROR_RESPONSES)


@network.get("/{sandbox_id}/network", response_model=NetworkInfo, response_model_exclude_none=True)
async def sandbox_network(svc: Svc, sandbox_id: str) -> NetworkInfo:
    """What the sandbox may reach now (the network object)."""
    return svc.network.info(sandbox_id)


@network.patch(
    "/{sandbox_id}/network", response_model=NetworkInfo, response_model_exclude_none=True
)
async def change_sandbox_network(svc: Svc, sandbox_id: str, body: NetworkPolicy) -> NetworkInfo:
    """Replace the policy of a running or paused sandbox: its next connection is judged
    by it, open connections it denies are closed now (``closed``); forks and branches
    taken after it, hibernation and a daemon restart keep it. 409 when hibernated."""
    return await svc.network.update(sandbox_id, body)


@network.get("/{sandbox_id}/egress", response_model=EgressPage)
async def sandbox_egress(
    svc: Svc,
    sandbox_id: str,
    after: Annotated[int, Query(ge=0, description="records after this id (0: the oldest)")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EgressPage:
    """What the guest reached and was refused through the egress proxy, oldest first
    (the newest 1000 connections and HTTP requests are kept)."""
    return svc.network.records(sandbox_id, after, limit)
