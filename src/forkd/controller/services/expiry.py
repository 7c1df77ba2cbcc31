"""What a sandbox's timeout does (its ``on_timeout``), run by the reaper at expiry.

- ``kill``: the sandbox is killed and forgotten, as ``DELETE`` does.
- ``pause``: it is paused (a paused one stays so); its timeout is cleared.
- ``hibernate``: it is written to disk and its QEMU ended (a hibernated one
  stays so); its timeout is cleared.
- ``branch``: it is branched (a snapshot of it as it was, ``timeout_branch``
  on its last info), then its VM is killed; the sandbox stays listed as
  ``dead`` until it is deleted. A branch refused for now (``Busy``: the
  branch cap, an upload crossing) is tried again at the next pass; one that
  fails otherwise leaves the sandbox paused, its state kept, not killed.

An idle timeout (``idle_timeout_s``: no API call touching the sandbox and no
process output for that long, while it runs) does the same ``on_timeout``.
Each expiry is written to the audit log, with the branch's tag (and
``"reason": "idle"`` for an idle one).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from forkd.controller.models import BranchRequest
from forkd.controller.services.activity import Activity
from forkd.controller.services.branches import BranchService
from forkd.controller.services.events import EventBus
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.pausing import PauseService
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.errors import Busy, ForkdError, StorageFull
from forkd.states import OnTimeout, SandboxState

log = logging.getLogger(__name__)

AuditWriter = Callable[..., None]  # AuditLog.write, or a stand-in


class Expiry:
    def __init__(
        self,
        store: Store,
        events: EventBus,
        activity: Activity,
        vms: LiveVMs,
        pausing: PauseService,
        branches: BranchService,
    ) -> None:
        self.store = store
        self.events = events
        self.activity = activity
        self.vms = vms
        self.pausing = pausing
        self.branches = branches
        self.audit: AuditWriter | None = None  # set by the app once its audit log is open

    async def expire(self, row: SandboxRow, idle: bool = False) -> None:
        """Carry out ``row.on_timeout`` for the sandbox whose timeout has passed, or,
        with ``idle``, whose idle timeout has (unless it moved meanwhile)."""
        now = self.store.get_sandbox(row.id)
        if now is None:
            return  # killed since the reaper read it
        if idle:
            if not self.activity.idle_expired(now):
                return  # used, or paused, since
        elif now.expires_at_unix is None or now.expires_at_unix > time.time():
            return  # its timeout moved since the reaper read it
        action = now.on_timeout if now.state != SandboxState.DEAD else OnTimeout.KILL
        log.info("sandbox %s reached its %stimeout: %s", row.id, "idle " if idle else "", action)
        self.events.publish(
            "expired", sandbox_id=row.id, action=action, reason="idle" if idle else "timeout"
        )
        record: dict[str, Any] = {"event": "timeout", "sandbox": row.id, "on_timeout": action}
        if idle:
            record["reason"] = "idle"
        if action in (OnTimeout.PAUSE, OnTimeout.HIBERNATE):
            hibernate = action == OnTimeout.HIBERNATE
            if now.state == SandboxState.RUNNING or (
                hibernate and now.state == SandboxState.PAUSED
            ):
                # On failure the next pass tries again; but a disk without room for its
                # memory will not have it in a second: it is paused instead, which
                # keeps its memory (reclaim hibernates it once there is room).
                try:
                    await self.pausing.pause(row.id, hibernate=hibernate)
                except StorageFull as exc:
                    log.warning("sandbox %s is paused, not hibernated: %s", row.id, exc)
                    record["error"] = str(exc)[:500]
                    await self._pause_instead(row.id)
            if not idle:  # an idle one keeps its lifetime (idleness stops while paused)
                self.store.update_sandbox(row.id, expires_at_unix=None)
        elif action == OnTimeout.BRANCH:
            try:
                tag = (await self.branches.branch(row.id, BranchRequest())).tag
            except Busy:
                return  # a cap or a crossing upload: the next pass tries again
            except ForkdError as exc:  # keep its state rather than lose it: pause it
                log.warning("sandbox %s: the branch at its timeout failed: %s", row.id, exc)
                record.update(branch=None, error=str(exc)[:500])
                await self._pause_instead(row.id)
            else:
                record["branch"] = tag
                await self.vms.mark_dead(row.id, "idle" if idle else "timeout")
                self.store.update_sandbox(row.id, expires_at_unix=None, timeout_branch=tag)
        else:
            await self.vms.remove(row.id, "idle" if idle else "timeout")
        if self.audit is not None:
            self.audit(**record)

    async def _pause_instead(self, sandbox_id: str) -> None:
        row = self.store.get_sandbox(sandbox_id)
        if row is not None and row.state == SandboxState.RUNNING:
            with contextlib.suppress(ForkdError):
                await self.pausing.pause(sandbox_id)
        self.store.update_sandbox(sandbox_id, expires_at_unix=None)
