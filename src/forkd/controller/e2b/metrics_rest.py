"""E2B's ``sandbox.get_metrics()``: forkd's reading of what a sandbox uses now (its
``GET /v1/sandboxes/{id}/metrics``), as E2B's SandboxMetric. forkd keeps no history of
a sandbox's figures, so the series is one sample: the reading made for the request
(when ``start``..``end`` holds now; none otherwise)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from forkd.controller.e2b.rest import Svc, alive
from forkd.controller.models import SandboxMetrics

metrics_rest = APIRouter()


def e2b_metric(m: SandboxMetrics) -> dict[str, object]:
    """One reading as E2B's SandboxMetric (a figure the guest did not give: 0)."""
    unix = datetime.fromisoformat(m.timestamp).timestamp()
    disk, memory = m.disk, m.memory
    return {
        "timestamp": m.timestamp,
        "timestampUnix": int(unix),
        "cpuCount": m.cpu.count or 1,
        "cpuUsedPct": m.cpu.percent or 0.0,
        "memUsed": memory.guest_used_bytes or 0,
        "memTotal": memory.guest_total_bytes or 0,
        "memCache": 0,
        "diskUsed": disk.used_bytes if disk else 0,
        "diskTotal": disk.total_bytes if disk else 0,
    }


@metrics_rest.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(
    sandbox_id: str,
    svc: Svc,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    alive(svc, sandbox_id)
    now = time.time()
    if (start is not None and start > now + 1) or (end is not None and end < now - 1):
        return JSONResponse([])
    return JSONResponse([e2b_metric(await svc.usage.of(sandbox_id))])
