"""Bash for E2B's code interpreter: the code runs as one of the sandbox's background
processes (``/bin/bash -c``), so a client that goes away can have it killed, and its
output is read as it comes, kept to :data:`MAX_KEPT_BYTES` a stream."""

from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass, field

from forkd.controller.models import OutputData, OutputExit, ProcessSignal, ProcessStart
from forkd.controller.services import Services
from forkd.errors import ForkdError

MAX_KEPT_BYTES = 1 << 20  # of each stream an execution answers with; the rest is counted
TIMEOUT_SECS = 3600.0  # then bash is killed (exit code 124)
EXIT_TIMEOUT = 124


@dataclass
class BashRun:
    """One execution: its process, once started, and what it printed."""

    svc: Services
    sandbox_id: str
    pid: int | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    dropped: int = 0
    exit_code: int | None = None

    @property
    def timed_out(self) -> bool:
        return self.exit_code == EXIT_TIMEOUT

    async def run(self, code: str, cwd: str) -> BashRun:
        argv = ["/bin/bash", "-c", code]
        started = await self.svc.processes.start(
            self.sandbox_id, ProcessStart(cmd=argv, cwd=cwd, timeout_s=TIMEOUT_SECS)
        )
        self.pid = started.pid
        events = await self.svc.processes.output(self.sandbox_id, started.pid, 0, follow=True)
        async for event in events:
            body = event.body
            if event.event in ("stdout", "stderr") and isinstance(body, OutputData):
                self._keep(event.event, body)
            elif event.event == "exit" and isinstance(body, OutputExit):
                self.exit_code = body.exit_code
        return self

    def _keep(self, stream: str, body: OutputData) -> None:
        data = body.data.encode() if body.encoding == "utf-8" else base64.b64decode(body.data)
        kept = self.stdout if stream == "stdout" else self.stderr
        room = max(0, MAX_KEPT_BYTES - len(kept))
        kept += data[:room]
        self.dropped += len(data) - min(room, len(data))

    async def kill(self) -> None:
        """The client went away: the process is killed (if it started)."""
        if self.pid is not None:
            with contextlib.suppress(ForkdError):
                await self.svc.processes.signal(self.sandbox_id, self.pid, ProcessSignal(signal=9))
