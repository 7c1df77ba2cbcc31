"""The routes of webhooks (``/v1/webhooks``): endpoints the daemon's events go to,
their deliveries, and a test message."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from forkd.controller.http_errors import ERROR_RESPONSES
from forkd.controller.models.webhooks import DeliveryInfo, WebhookCreate, WebhookInfo, WebhookTest
from forkd.controller.routes.common import NO_CONTENT, Svc
from forkd.controller.services import Services
from forkd.controller.webhooks.tables import DeliveryRow, WebhookRow

webhooks = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=ERROR_RESPONSES)
WebhookIdP = Annotated[str, Path(pattern=r"^wh_[0-9a-f]{16}$")]


def _info(svc: Services, row: WebhookRow, secret: str | None = None) -> WebhookInfo:
    return WebhookInfo(
        id=row.id,
        url=row.url,
        events=list(row.events),
        description=row.description,
        created_at_unix=row.created_at_unix,
        pending=svc.webhooks.pending(row.id),
        secret=secret,
    )


def _delivery(row: DeliveryRow) -> DeliveryInfo:
    return DeliveryInfo(
        msg_id=row.msg_id,
        event=row.event,
        status=row.status,
        attempts=row.attempts,
        created_at_unix=row.created_at_unix,
        next_attempt_unix=row.next_at_unix if row.status == "pending" else None,
        last_status=row.last_status,
        last_error=row.last_error,
        last_latency_ms=row.last_latency_ms,
        ended_at_unix=row.ended_at_unix,
    )


@webhooks.post("", status_code=201, response_model=WebhookInfo, response_model_exclude_none=True)
async def create_webhook(svc: Svc, body: WebhookCreate) -> WebhookInfo:
    """An endpoint; the daemon's events it takes are delivered to it from now on. A
    non-public address is refused unless the operator allowed it (``--webhook-allow``)."""
    row, made = await svc.webhooks.add(body.url, body.events, body.secret, body.description)
    return _info(svc, row, made)


@webhooks.get("", response_model=list[WebhookInfo], response_model_exclude_none=True)
async def list_webhooks(svc: Svc) -> list[WebhookInfo]:
    """Every endpoint; never a secret."""
    return [_info(svc, row) for row in svc.webhooks.all()]


@webhooks.get("/{webhook_id}", response_model=WebhookInfo, response_model_exclude_none=True)
async def webhook_info(svc: Svc, webhook_id: WebhookIdP) -> WebhookInfo:
    return _info(svc, svc.webhooks.get(webhook_id))


@webhooks.delete("/{webhook_id}", **NO_CONTENT)
async def delete_webhook(svc: Svc, webhook_id: WebhookIdP) -> Response:
    """The endpoint, and what was still to be delivered to it."""
    svc.webhooks.delete(webhook_id)
    return Response(status_code=204)


@webhooks.get("/{webhook_id}/deliveries", response_model=list[DeliveryInfo])
async def deliveries(
    svc: Svc, webhook_id: WebhookIdP, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[DeliveryInfo]:
    """Its latest deliveries, newest first: each one's status, attempts and last answer."""
    return [_delivery(row) for row in svc.webhooks.deliveries(webhook_id, limit)]


@webhooks.post("/{webhook_id}/test", status_code=202, response_model=WebhookTest)
async def test_webhook(svc: Svc, webhook_id: WebhookIdP) -> WebhookTest:
    """A ``webhook.test`` message to that endpoint, delivered as any other."""
    return WebhookTest(msg_id=svc.webhooks.test(webhook_id))
