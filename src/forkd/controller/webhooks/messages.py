"""What a webhook is told: the daemon's events by their webhook names, each a Standard
Webhooks message (``{"type", "timestamp", "data"}``), and the checks of an endpoint's
URL, events and secret."""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from typing import Any
from urllib.parse import urlsplit

from forkd.errors import Invalid

# The daemon's event types (forkd.controller.services.events) a webhook can take.
WEBHOOK_EVENTS = {
    "created": "sandbox.created",
    "paused": "sandbox.paused",
    "resumed": "sandbox.resumed",
    "hibernated": "sandbox.hibernated",
    "expired": "sandbox.expired",
    "killed": "sandbox.killed",
    "died": "sandbox.died",
    "branched": "sandbox.branched",
    "explored": "sandbox.explored",
    "network_changed": "sandbox.network_changed",
    "stop_hook": "sandbox.stop_hook",
    "wake_failed": "sandbox.wake_failed",
    "snapshot_created": "snapshot.created",
    "snapshot_deleted": "snapshot.deleted",
    "webhook_failed": "webhook.failed",
}
TEST_EVENT = "webhook.test"  # POST /v1/webhooks/{id}/test: to that endpoint only
FAILED_EVENT = "webhook.failed"  # only to a webhook that names it (not in *)
ALL = "*"
NAMES = frozenset(WEBHOOK_EVENTS.values())
SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES = 24
MAX_SECRET_BYTES = 64
MAX_URL_CHARS = 2048
_HEADER = ("id", "type", "time")  # an event's keys that are not its data


def check_url(url: str) -> str:
    """An endpoint's URL: http or https, a host, no credentials in it."""
    if len(url) > MAX_URL_CHARS:
        raise Invalid(f"a webhook URL is at most {MAX_URL_CHARS} characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid(f"a webhook URL is http:// or https:// with a host, not {url[:100]!r}")
    if parts.username is not None or parts.password is not None:
        raise Invalid("a webhook URL carries no credentials: the signature is the proof")
    try:
        parts.port  # noqa: B018 (a port out of range raises here)
    except ValueError as exc:
        raise Invalid(f"the webhook URL's port: {exc}") from None
    return url


def check_events(events: list[str]) -> tuple[str, ...]:
    unknown = [e for e in events if e != ALL and e not in NAMES]
    if unknown:
        raise Invalid(f"unknown webhook event {unknown[0]!r}: one of {', '.join(sorted(NAMES))}")
    return tuple(dict.fromkeys(events)) or (ALL,)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(MIN_SECRET_BYTES)).decode()


def check_secret(secret: str) -> str:
    """A secret as Standard Webhooks has them: ``whsec_`` and base64 of 24-64 bytes."""
    try:
        raw = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (binascii.Error, ValueError):
        raise Invalid("a webhook secret is whsec_ followed by base64") from None
    if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        raise Invalid(f"a webhook secret holds {MIN_SECRET_BYTES}-{MAX_SECRET_BYTES} bytes")
    return secret if secret.startswith(SECRET_PREFIX) else SECRET_PREFIX + secret


def wants(events: tuple[str, ...], name: str) -> bool:
    if name == TEST_EVENT:
        return False  # sent only when asked for, to the one endpoint
    if name == FAILED_EVENT:
        return name in events  # asked for by name: a catch-all takes no failures
    return ALL in events or name in events


def message(name: str, event: dict[str, Any], sandbox: dict[str, Any] | None) -> str:
    """The body a webhook receives: the event's name, time and fields, with the sandbox's
    snapshot tag and labels when it has a record."""
    data = {k: v for k, v in event.items() if k not in _HEADER}
    if sandbox is not None:
        data["sandbox"] = sandbox
    body = {"type": name, "timestamp": event.get("time"), "data": data}
    return json.dumps(body, default=str, separators=(",", ":"))
