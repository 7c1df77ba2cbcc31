"""The guest agent's operations (docs/guest-agent.md) as methods of a VM.

:class:`forkd.vmm.agent_client.AgentClient` is the transport (one
connection, requests matched to answers by id); this is what travels on it.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from forkd import limits
from forkd.vmm.agent_client import AgentClient

PING_WAIT_SECS = 10.0
EXEC_WAIT_MARGIN_SECS = 10.0  # beyond the command's own timeout, for the agent to answer
RESTORE_ENTROPY_BYTES = 64


class GuestOps:
    """Mixed into :class:`forkd.vmm.vm.VM`: the calls a sandbox's users make."""

    agent: AgentClient

    async def ping(self) -> dict[str, Any]:
        return await self.agent.call("ping", wait=PING_WAIT_SECS)

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float = limits.EXEC_TIMEOUT_SECS,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
    ) -> dict[str, Any]:
        params = {"argv": argv, "cwd": cwd, "env": env, "stdin": stdin, "timeout": timeout}
        return await self.agent.call("exec", params, wait=timeout + EXEC_WAIT_MARGIN_SECS)

    async def eval(self, code: str, timeout: float = limits.EVAL_TIMEOUT_SECS) -> dict[str, Any]:
        return await self.agent.call("eval", {"code": code}, wait=timeout)

    async def read_file(self, path: str) -> bytes:
        result = await self.agent.call("file_read", {"path": path})
        return base64.b64decode(result["data"])

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        params = {"path": path, "data": base64.b64encode(data).decode(), "mode": mode}
        result = await self.agent.call("file_write", params)
        return int(result["size"])

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        return (await self.agent.call("file_list", {"path": path}))["entries"]

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self.agent.call("file_remove", {"path": path, "recursive": recursive})

    async def _make_unique(self, hostname: str, wait: float) -> dict[str, Any]:
        """After a restore: the wall-clock time, fresh entropy and a new hostname."""
        params = {
            "time_ns": time.time_ns(),
            "entropy": base64.b64encode(os.urandom(RESTORE_ENTROPY_BYTES)).decode(),
            "hostname": hostname,
        }
        return await self.agent.call("restore", params, wait=wait)
