"""``forkd fork --settle-secs S``: fork, hold the sandboxes, then remove them.

The original forkd's ``fork`` restored children, let them run for ``--settle-secs`` and
shut them down; its Python SDK's ``Sandbox()`` runs exactly ``forkd fork --tag T -n 1
--settle-secs 3600`` and talks to the child at ``FORKD_TARGET``. Here the daemon forks
them; given an address (``--agent-address``, or ``FORKD_TARGET`` in the environment
the SDK passes on), the first sandbox answers the original agent protocol there
(:mod:`forkd.cli.agent_relay`). The hold ends at ``S`` seconds, on Ctrl-C or on
SIGTERM (the SDK's ``kill()``), and the sandboxes are removed. Each is also given a
timeout a minute past ``S``, so the daemon removes them if this process is killed
outright.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import typer

from forkd.cli import render
from forkd.cli.agent_relay import AgentRelay, parse_address
from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection
from forkd.cli.render import err, out, shown
from forkd.client import ControllerError

HOLD_MARGIN_SECS = 60.0  # the daemon's timeout on a held sandbox, past the hold


class Hold:
    def __init__(
        self, conn: Connection, tag: str, n: int, settle_secs: float, agent_address: str | None
    ) -> None:
        self.conn, self.tag, self.n = conn, tag, n
        self.settle_secs = settle_secs
        self.agent_address = agent_address
        self.stop = threading.Event()

    def run(self, **spawn: Any) -> None:
        relay = self._bind() if self.agent_address else None
        if spawn.get("timeout_secs") is None:
            spawn["timeout_secs"] = self.settle_secs + HOLD_MARGIN_SECS
        t0 = time.monotonic()
        try:
            with daemon_errors(), self.conn.controller() as ctl:
                sandboxes = ctl.spawn_sandboxes(self.tag, n=self.n, **spawn)
        except BaseException:
            if relay is not None:
                relay.server_close()
            raise
        took = time.monotonic() - t0
        ids = [str(sb["id"]) for sb in sandboxes]
        if self.conn.as_json:
            render.print_json(sandboxes)
        else:
            out.print(render.sandbox_table(sandboxes))
            out.print(wall_clock_line(took), highlight=False)
        where = ""
        if relay is not None:
            relay.sandbox_id = ids[0]
            relay.serve_in_background()
            where = f"; {ids[0]} answers the agent protocol at {self.agent_address}"
        err.print(
            f"forked {len(ids)} from {shown(self.tag)} in {took:.2f} s; holding them "
            f"{self.settle_secs:g} s (Ctrl-C or SIGTERM ends it){where}"
        )
        self._wait()
        if relay is not None:
            relay.shutdown()
            relay.server_close()
        self._remove(ids)

    def _bind(self) -> AgentRelay:
        assert self.agent_address is not None
        try:
            address = parse_address(self.agent_address)
            return AgentRelay(address, self.conn.controller, sandbox_id="")
        except (ValueError, OSError) as exc:
            err.print(
                f"cannot serve the agent protocol at {shown(self.agent_address)} "
                f"(--agent-address or FORKD_TARGET): {shown(str(exc))}; use a local "
                "address, e.g. FORKD_TARGET=127.0.0.1:18888"
            )
            raise typer.Exit(1) from exc

    def _wait(self) -> None:
        handlers = {
            sig: signal.signal(sig, lambda *_: self.stop.set())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self.stop.wait(self.settle_secs)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _remove(self, ids: list[str]) -> None:
        with self.conn.controller() as ctl:
            for sid in ids:
                try:
                    ctl.kill_sandbox(sid)
                except ControllerError as exc:
                    if exc.status != 404:  # already gone: its timeout, or someone else
                        err.print(f"could not remove {sid}: {shown(str(exc))}")
        err.print(f"removed {len(ids)} held sandbox{'es' if len(ids) != 1 else ''}")


def wall_clock_line(seconds: float) -> str:
    """The original forkd's fork summary, whose fourth field its bench scripts read:
    ``✓ total wall-clock: 412 ms``."""
    return f"\u2713 total wall-clock: {seconds * 1000:.0f} ms"
