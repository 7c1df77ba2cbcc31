"""An image import with its progress (``POST /v1/images`` as Server-Sent Events), as a
method of :class:`~forkd.client.Controller`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from httpx_sse import EventSource

from forkd.client.errors import ControllerError

IMPORT_TIMEOUT_SECS = 3600.0
STREAM_READ_TIMEOUT_SECS = 60.0  # the daemon sends a keep-alive every 15 s of silence


class ImageRoutes:
    """Mixed into Controller: an import that reports its steps as they happen."""

    url: str
    _client: httpx.Client

    def import_image_progress(
        self, ref: str, on_progress: Callable[[str], None], token: str | None = None
    ) -> dict[str, Any]:
        """:meth:`import_image`, calling ``on_progress`` with each step (layers fetched,
        bytes, flattening) as the daemon takes it; the image's info at the end."""
        body = {"ref": ref, **({"token": token} if token else {})}
        timeout = httpx.Timeout(IMPORT_TIMEOUT_SECS, read=STREAM_READ_TIMEOUT_SECS)
        with self._client.stream(
            "POST", "/v1/images", json=body, timeout=timeout,
            headers={"Accept": "text/event-stream"},
        ) as resp:  # fmt: skip
            if not resp.is_success:
                resp.read()
                raise ControllerError.from_response(resp)
            for sse in EventSource(resp).iter_sse():
                if sse.event == "progress":
                    on_progress(str(json.loads(sse.data).get("message", "")))
                elif sse.event == "image":
                    return dict(json.loads(sse.data))
                elif sse.event == "error":
                    failure = json.loads(sse.data)
                    raise ControllerError(int(failure.get("status", 500)), failure.get("error"))
        raise ControllerError(0, f"the forkd daemon at {self.url} ended the import unanswered")
