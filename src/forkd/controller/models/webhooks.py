"""The bodies and answers of ``/v1/webhooks``: endpoints the daemon's events are delivered
to, signed as Standard Webhooks sign them, and each delivery's attempts."""

from __future__ import annotations

from pydantic import BaseModel, Field

from forkd.controller.models.common import StrictBody
from forkd.controller.webhooks.messages import MAX_URL_CHARS


class WebhookCreate(StrictBody):
    url: str = Field(max_length=MAX_URL_CHARS, description="http:// or https://")
    events: list[str] = Field(
        default_factory=lambda: ["*"],
        max_length=32,
        description="webhook event names (sandbox.killed, ...), or * for every one",
    )
    secret: str | None = Field(
        None,
        max_length=128,
        description="whsec_ and base64 of 24-64 bytes; none: the daemon makes one, shown "
        "once in the answer",
    )
    description: str = Field("", max_length=256)


class WebhookInfo(BaseModel):
    id: str
    url: str
    events: list[str]
    description: str
    created_at_unix: float
    pending: int = Field(description="deliveries waiting to go out")
    secret: str | None = Field(
        None, description="only in the answer to its creation, and only when the daemon made it"
    )


class DeliveryInfo(BaseModel):
    msg_id: str = Field(description="the webhook-id header: the same for every attempt")
    event: str
    status: str = Field(description="pending, delivered or failed")
    attempts: int
    created_at_unix: float
    next_attempt_unix: float | None = Field(description="when it is tried next (pending)")
    last_status: int | None = Field(description="the HTTP status of the last answer")
    last_error: str | None
    last_latency_ms: float | None
    ended_at_unix: float | None


class WebhookTest(BaseModel):
    msg_id: str
