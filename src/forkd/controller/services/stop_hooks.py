"""Stop hooks: a command a sandbox runs in its guest before the daemon stops it (a
``DELETE`` without ``force``, its timeout or idle timeout, a hibernation of any cause,
the daemon's own stop under ``--kill-on-exit``), as a database runs its clean shutdown.

A hook belongs to a template (``on_stop`` at ``POST /v1/snapshots``), which every fork
takes, to a fork (``on_stop`` at ``POST /v1/sandboxes``, over its template's), and to a
branch (its source's). It runs for at most its ``on_stop_timeout_s``, then the stop goes
on whatever it did; what it printed is in a ``stop_hook`` event. Hooks are kept in their
own table of the daemon's store, a snapshot's together with the time it was made, so a
tag made again later does not take an old hook.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from forkd.controller.services.events import EventBus
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.store import Store
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS stop_hooks (
    kind      TEXT NOT NULL,
    key       TEXT NOT NULL,
    made_at   REAL NOT NULL,
    command   TEXT NOT NULL,
    timeout_s REAL NOT NULL,
    PRIMARY KEY (kind, key)
)
"""
OUTPUT_TAIL_CHARS = 2000  # of what a hook printed, in its event
GRACE_SECS = 2.0  # past its timeout, for the agent's answer (a wedged guest: cut off)
# The removals a sandbox's hook runs before (a DELETE with force, a failed fork, an
# explore's discarded children do not run it).
HOOKED = frozenset({"user", "timeout", "idle", "daemon_shutdown"})


@dataclass(frozen=True)
class StopHook:
    command: str
    timeout_s: float


class StopHooks:
    def __init__(self, store: Store, events: EventBus) -> None:
        self.store = store
        self.events = events
        with store.transaction() as db:
            db.execute(SCHEMA)

    def _set(self, kind: str, keys: list[str], made_at: float, hook: StopHook | None) -> None:
        """``keys``' hook (none: dropped), in one transaction."""
        with self.store.transaction() as db:
            db.executemany(
                "DELETE FROM stop_hooks WHERE kind = ? AND key = ?", [(kind, k) for k in keys]
            )
            if hook is not None:
                db.executemany(
                    "INSERT INTO stop_hooks VALUES (?, ?, ?, ?, ?)",
                    [(kind, k, made_at, hook.command, hook.timeout_s) for k in keys],
                )

    def _get(self, kind: str, key: str) -> tuple[float, StopHook] | None:
        rows = self.store.query(
            "SELECT made_at, command, timeout_s FROM stop_hooks WHERE kind = ? AND key = ?",
            (kind, key),
        )
        if not rows:
            return None
        return float(rows[0]["made_at"]), StopHook(rows[0]["command"], rows[0]["timeout_s"])

    def of_snapshot(self, tag: str) -> StopHook | None:
        """The template's hook, if it is this snapshot's (not an earlier one's of that tag)."""
        found, row = self._get("snapshot", tag), self.store.get_snapshot(tag)
        if found is None or row is None or abs(found[0] - row.created_at_unix) > 1:
            return None
        return found[1]

    def of_sandbox(self, sandbox_id: str) -> StopHook | None:
        found = self._get("sandbox", sandbox_id)
        return found[1] if found is not None else None

    def for_snapshot(self, tag: str, hook: StopHook | None) -> None:
        """A template made now with ``hook`` (or none: an old one of its tag is dropped)."""
        row = self.store.get_snapshot(tag)
        self._set("snapshot", [tag], row.created_at_unix if row else 0.0, hook)

    def forget_snapshot(self, tag: str) -> None:
        self._set("snapshot", [tag], 0.0, None)

    def for_children(self, ids: list[str], tag: str, given: StopHook | None) -> None:
        """Forks of ``tag``: ``given``, else their template's."""
        hook = given or self.of_snapshot(tag)
        if hook is not None:
            self._set("sandbox", ids, 0.0, hook)

    def for_branch(self, sandbox_id: str, tag: str) -> None:
        """A branch of ``sandbox_id`` takes its hook (its forks then do)."""
        self.for_snapshot(tag, self.of_sandbox(sandbox_id))

    async def before_removal(
        self, sandbox_id: str, vm: SandboxVM | None, reason: str | None
    ) -> None:
        """A sandbox is removed: its hook run (for the :data:`HOOKED` reasons, while it
        has a VM), then dropped. One read when it has none."""
        hook = self.of_sandbox(sandbox_id)
        if hook is None:
            return
        if vm is not None and reason in HOOKED:
            await self._run(sandbox_id, vm, reason, hook)
        self._set("sandbox", [sandbox_id], 0.0, None)

    async def run(self, sandbox_id: str, vm: SandboxVM, reason: str) -> None:
        """The sandbox's hook, if it has one, before it is stopped for ``reason``."""
        hook = self.of_sandbox(sandbox_id)
        if hook is not None:
            await self._run(sandbox_id, vm, reason, hook)

    async def _run(self, sandbox_id: str, vm: SandboxVM, reason: str, hook: StopHook) -> None:
        """At most the hook's timeout (and a grace for the agent), then the stop goes on."""
        if not vm.is_alive():
            return
        said: dict[str, Any] = {"reason": reason, "command": hook.command}
        try:
            ran = await asyncio.wait_for(
                vm.guest.exec(["/bin/sh", "-c", hook.command], timeout=hook.timeout_s),
                hook.timeout_s + GRACE_SECS,
            )
            output = (ran["stdout"] + ran["stderr"])[-OUTPUT_TAIL_CHARS:]
            said.update(
                exit_code=ran["exit_code"], timed_out=bool(ran.get("timed_out")), output=output
            )
        except (TimeoutError, ForkdError) as exc:  # a guest that does not answer: cut off
            said.update(exit_code=None, timed_out=isinstance(exc, TimeoutError), error=str(exc))
        log.info(
            "sandbox %s: its stop hook ran (%s): exit %s", sandbox_id, reason, said["exit_code"]
        )
        self.events.publish("stop_hook", sandbox_id=sandbox_id, **said)
