"""E2B's secrets, which are forkd's (sealed at rest, never in a guest, put into a request
by the egress proxy in place of ``${e2b.secrets.NAME}``, on the secret's own hosts only).

E2B's secrets have no hosts of their own; forkd's always do, since a placeholder a guest
sends anywhere else must stay a placeholder. So a secret made through E2B's API names its
hosts in its metadata: ``metadata={"hosts": "api.example.com,*.example.org"}``; one
without is refused. A secret's id is its name. Values are write-only, as E2B's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.models import Body, validated
from forkd.controller.e2b.paging import paged
from forkd.controller.e2b.rest import Svc
from forkd.controller.models.network import SecretCreate, SecretInfo, SecretUpdate
from forkd.errors import Invalid

secrets_rest = APIRouter()
MAX_PAGE = 100


class NewSecret(Body):
    name: str
    value: str
    metadata: dict[str, str] | None = None


class SecretChange(Body):
    value: str
    metadata: dict[str, str] | None = None


def _hosts(metadata: dict[str, str] | None, required: bool) -> list[str] | None:
    given = (metadata or {}).get("hosts")
    if given is None:
        if required:
            raise Invalid(
                "forkd sends a secret to its own hosts only: name them in its metadata, "
                "hosts='api.example.com,*.example.org'"
            )
        return None
    return [h.strip() for h in given.split(",") if h.strip()]


def _secret(info: SecretInfo) -> dict[str, object]:
    def iso(unix: float) -> str:
        return datetime.fromtimestamp(unix, tz=UTC).isoformat()

    return {
        "secretID": info.name,
        "name": info.name,
        "currentVersion": 1,
        "metadata": {"hosts": ",".join(info.hosts)},
        "createdAt": iso(info.created_at_unix),
        "updatedAt": iso(info.updated_at_unix),
    }


@secrets_rest.post("/secrets", status_code=201)
async def create_secret(body: NewSecret, svc: Svc) -> Response:
    fields: dict[str, Any] = {
        "name": body.name,
        "value": body.value,
        "hosts": _hosts(body.metadata, True),
    }
    made = validated(SecretCreate, fields)
    return JSONResponse(_secret(svc.secrets.create(made)), status_code=201)


@secrets_rest.get("/secrets")
async def list_secrets(
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    found = sorted(svc.secrets.list(), key=lambda i: i.name)
    page, headers = paged(found, lambda i: i.name, limit, next_token, "secret")
    return JSONResponse([_secret(i) for i in page], headers=headers)


@secrets_rest.get("/secrets/{secret_id}")
async def get_secret(secret_id: str, svc: Svc) -> Response:
    return JSONResponse(_secret(svc.secrets.info(secret_id)))


@secrets_rest.post("/secrets/{secret_id}")
async def update_secret(secret_id: str, body: SecretChange, svc: Svc) -> Response:
    change = validated(SecretUpdate, {"value": body.value, "hosts": _hosts(body.metadata, False)})
    return JSONResponse(_secret(svc.secrets.update(secret_id, change)))


@secrets_rest.delete("/secrets/{secret_id}", status_code=204)
async def delete_secret(secret_id: str, svc: Svc) -> Response:
    svc.secrets.delete(secret_id, named_by=svc.network.rules_naming(secret_id))
    return Response(status_code=204)
