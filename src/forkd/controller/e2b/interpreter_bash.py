"""Bash for E2B's code interpreter: the code runs as one of the sandbox's background
processes (``/bin/bash -c``), its output passed on as it comes (each stream kept to
:data:`MAX_KEPT_BYTES`), and killed when the client goes away."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from forkd.controller.models import OutputData, OutputExit, ProcessSignal, ProcessStart
from forkd.controller.services import Services
from forkd.errors import ForkdError

MAX_KEPT_BYTES = 1 << 20  # of each stream an execution passes on; the rest is dropped
TIMEOUT_SECS = 3600.0  # then bash is killed (exit code 124)
EXIT_TIMEOUT = 124


async def bash_lines(
    svc: Services, sandbox_id: str, code: str, cwd: str, env: dict[str, str] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """E2B's lines of ``code`` run in bash in ``cwd`` (with ``env`` over the sandbox's
    environment): its output, then its error if it failed."""
    started = await svc.processes.start(
        sandbox_id,
        ProcessStart(cmd=["/bin/bash", "-c", code], cwd=cwd, env=env, timeout_s=TIMEOUT_SECS),
    )
    kept = {"stdout": 0, "stderr": 0}
    stderr = bytearray()
    exit_code: int | None = None
    try:
        events = await svc.processes.output(sandbox_id, started.pid, 0, follow=True)
        async for event in events:
            body = event.body
            if event.event in ("stdout", "stderr") and isinstance(body, OutputData):
                data = body.raw()[: max(0, MAX_KEPT_BYTES - kept[event.event])]
                kept[event.event] += len(data)
                if event.event == "stderr":
                    stderr += data
                if data:
                    text = data.decode("utf-8", "replace")
                    yield {"type": event.event, "text": text, "timestamp": time.time_ns()}
            elif event.event == "exit" and isinstance(body, OutputExit):
                exit_code = body.exit_code
    finally:
        if exit_code is None:  # the client went away (or the stream failed): stop it
            with anyio.CancelScope(shield=True), contextlib.suppress(ForkdError):
                await svc.processes.signal(sandbox_id, started.pid, ProcessSignal(signal=9))
    if exit_code not in (0, None):
        status = "timed out" if exit_code == EXIT_TIMEOUT else f"exit status {exit_code}"
        traceback = stderr.decode("utf-8", "replace")
        yield {"type": "error", "name": "ShellError", "value": status, "traceback": traceback}
