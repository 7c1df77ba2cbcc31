"""What a sandbox's timeout does (its ``on_timeout``), run by the reaper at expiry.

- ``kill``: the sandbox is killed and forgotten, as ``DELETE`` does.
- ``pause``: it is paused (a paused one stays so); its timeout is cleared.
- ``branch``: it is branched (a snapshot of it as it was, ``timeout_branch``
  on its last info), then its VM is killed; the sandbox stays listed as
  ``dead`` until it is deleted. A branch that fails still ends the sandbox.

Each expiry is written to the audit log, with the branch's tag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from forkd.controller.models import BranchRequest
from forkd.controller.services.branches import BranchService
from forkd.controller.services.fleet import Fleet
from forkd.controller.services.pausing import PauseService
from forkd.controller.store import SandboxRow
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

AuditWriter = Callable[..., None]  # AuditLog.write, or a stand-in


class Expiry:
    def __init__(self, fleet: Fleet, pausing: PauseService, branches: BranchService) -> None:
        self.fleet = fleet
        self.pausing = pausing
        self.branches = branches
        self.audit: AuditWriter | None = None  # set by the app once its audit log is open

    async def expire(self, row: SandboxRow) -> None:
        """Carry out ``row.on_timeout`` for the sandbox whose timeout has passed."""
        action = row.on_timeout if row.state != "dead" else "kill"
        log.info("sandbox %s reached its timeout: %s", row.id, action)
        record: dict[str, Any] = {"event": "timeout", "sandbox": row.id, "on_timeout": action}
        if action == "pause":
            self.fleet.store.update_sandbox(row.id, expires_at_unix=None)
            if row.state == "running":
                await self.pausing.pause(row.id)
        elif action == "branch":
            record["branch"] = await self._branch_then_end(row)
        else:
            await self.fleet.remove(row.id)
        if self.audit is not None:
            self.audit(**record)

    async def _branch_then_end(self, row: SandboxRow) -> str | None:
        tag: str | None = None
        try:
            tag = (await self.branches.branch(row.id, BranchRequest())).tag
        except ForkdError as exc:
            log.warning("sandbox %s: the branch at its timeout failed: %s", row.id, exc)
        await self.fleet.mark_dead(row.id)
        self.fleet.store.update_sandbox(row.id, expires_at_unix=None, timeout_branch=tag)
        return tag
