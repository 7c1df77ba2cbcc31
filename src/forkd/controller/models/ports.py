"""Guest ports: preview URLs and the daemon's proxy URL."""

from __future__ import annotations

from pydantic import BaseModel, Field

from forkd import limits
from forkd.controller.models.common import StrictBody


class PreviewRequest(StrictBody):
    port: int = Field(ge=1, le=65535, description="the guest's TCP port (not 8888, the agent's)")
    ttl_s: int = Field(
        limits.DEFAULT_PREVIEW_TTL_SECS,
        ge=1,
        le=limits.MAX_PREVIEW_TTL_SECS,
        description="seconds until the URL stops working (it also stops when the sandbox dies)",
    )


class PortUrlRequest(StrictBody):
    ttl_s: int = Field(
        limits.DEFAULT_PREVIEW_TTL_SECS,
        ge=1,
        le=limits.MAX_PREVIEW_TTL_SECS,
        description="seconds until the URL stops working (it also stops when the sandbox dies)",
    )


class PreviewInfo(BaseModel):
    """A signed URL for a browser: the sandbox's port without the bearer token."""

    url: str = Field(
        description="absolute: this daemon as the request reached it, or the preview's own "
        "host under --preview-domain"
    )
    token: str = Field(description="p1.<sandbox id>.<port>.<expires at, unix s>.<HMAC-SHA256>")
    expires_at: str = Field(description="ISO 8601 UTC")
    expires_at_unix: int
    port: int
