"""E2B's sandbox logs (``GET /sandboxes/{id}/logs`` and ``/v2/sandboxes/{id}/logs``):
the daemon's events of that sandbox, still held in its event ring (created, paused,
resumed, branched, each connection the egress proxy let out or refused, ...; the ring
keeps the daemon's last :data:`forkd.limits.EVENT_RING_SIZE` events of every sandbox).

forkd has no log of its own inside the guest: a command's output is the command's
(``commands.run``), and this is what the daemon saw of the sandbox from outside."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.rest import Svc, alive

logs_rest = APIRouter()

MAX_LOGS = 1000  # entries of one answer (E2B's default and its most)
LEVELS = ("debug", "info", "warn", "error")
_HEADER = ("id", "type", "time", "sandbox_id")  # an event's keys that are not its fields
Limit = Annotated[int, Query(ge=0, le=MAX_LOGS)]


def _unix_ms(event: dict[str, Any]) -> int:
    return int(datetime.fromisoformat(str(event["time"])).timestamp() * 1000)


def _level(event: dict[str, Any]) -> str:
    kind = event.get("type")
    if kind == "died":
        return "error"
    if kind == "egress" and event.get("verdict") == "refused":
        return "warn"
    return "info"


def _entry(event: dict[str, Any]) -> dict[str, Any]:
    """One event as E2B's SandboxLogEntry: its type and fields, as one line and as the
    entry's string ``fields``."""
    fields = {k: str(v) for k, v in event.items() if k not in _HEADER and v is not None}
    line = " ".join([str(event["type"]), *(f"{k}={v}" for k, v in fields.items())])
    return {
        "timestamp": event["time"],
        "level": _level(event),
        "message": line,
        "fields": {"type": str(event["type"]), **fields},
    }


@logs_rest.get("/sandboxes/{sandbox_id}/logs")
async def logs(
    sandbox_id: str,
    svc: Svc,
    start: Annotated[int | None, Query(ge=0, description="unix ms: entries from then")] = None,
    limit: Limit = MAX_LOGS,
) -> Response:
    alive(svc, sandbox_id)
    events = [e for e in svc.events.held(sandbox_id) if start is None or _unix_ms(e) >= start]
    entries = [_entry(e) for e in events[:limit]]
    lines = [{"timestamp": e["timestamp"], "line": e["message"]} for e in entries]
    return JSONResponse({"logs": lines, "logEntries": entries})


@logs_rest.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(
    sandbox_id: str,
    svc: Svc,
    cursor: Annotated[int | None, Query(ge=0, description="unix ms to start from")] = None,
    limit: Limit = MAX_LOGS,
    direction: Literal["forward", "backward"] = "forward",
    level: Literal["debug", "info", "warn", "error"] | None = None,
    search: Annotated[str | None, Query(max_length=256)] = None,
) -> Response:
    alive(svc, sandbox_id)
    events = svc.events.held(sandbox_id)
    if direction == "backward":
        events.reverse()
    if cursor is not None:
        sign = 1 if direction == "forward" else -1  # backward: from the cursor back
        events = [e for e in events if sign * (_unix_ms(e) - cursor) >= 0]
    least = LEVELS.index(level) if level is not None else 0
    entries = [
        entry
        for entry in map(_entry, events)
        if LEVELS.index(entry["level"]) >= least and (not search or search in entry["message"])
    ]
    return JSONResponse({"logs": entries[:limit]})
