"""Lifecycle events from a real daemon: one sandbox forked, branched and killed, seen in
order by an SDK subscriber (``GET /v1/events``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from forkd.client import Controller
from tests.integration.conftest import Daemon


def test_fork_branch_kill_are_seen_in_order(
    daemon: Daemon, ctl: Controller, api_template: str
) -> None:
    seen: list[Any] = []
    watcher = Controller(daemon.url, token=daemon.token)
    stream = watcher.events(types=["created", "branched", "killed", "snapshot_deleted"])

    def read() -> None:
        try:
            for event in stream:
                seen.append(event)
        except Exception:  # the watcher is closed at the end of the test
            pass

    threading.Thread(target=read, daemon=True).start()
    time.sleep(1.0)  # the stream is open before the fork
    sid = ctl.spawn_sandboxes(api_template)[0]["id"]
    tag = ctl.branch_sandbox(sid, f"events-{sid}")["tag"]
    ctl.kill_sandbox(sid)
    ctl.delete_snapshot(tag)
    deadline = time.monotonic() + 10
    while len([e for e in seen if e.sandbox_id == sid or e.snapshot_tag == tag]) < 4:
        assert time.monotonic() < deadline, f"not in time: {seen}"
        time.sleep(0.05)
    mine = [e for e in seen if e.sandbox_id == sid or e.snapshot_tag == tag]
    assert [e.type for e in mine] == ["created", "branched", "killed", "snapshot_deleted"]
    created, branched, killed, _ = mine
    assert created.snapshot_tag == api_template and created["fork_ms"] > 0
    assert branched.snapshot_tag == tag and branched["pause_ms"] > 0
    assert created.id < branched.id < killed.id
    watcher.close()
