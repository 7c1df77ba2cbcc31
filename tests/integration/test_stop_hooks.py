"""Stop hooks in a real guest: the hook runs before a hibernation (what it wrote is there
when the sandbox wakes) and before a kill, and one that overruns is cut off at its
timeout and the kill goes on."""

from __future__ import annotations

import time

import pytest

from forkd.client import Controller

pytestmark = pytest.mark.integration


def test_a_stop_hook_runs_before_a_hibernation_and_a_kill(
    ctl: Controller, api_template: str
) -> None:
    hook = "echo clean > /work/stopped.txt && sync"
    [sb] = ctl.spawn_sandboxes(api_template, on_stop=hook, on_stop_timeout_s=20)
    slow_id = None
    try:
        ctl.pause_sandbox(sb["id"], hibernate=True)
        ctl.resume_sandbox(sb["id"])
        ran = ctl.exec_command(sb["id"], ["cat", "/work/stopped.txt"])
        assert ran["stdout"] == "clean\n", ran  # written before the snapshot was taken
        [slow] = ctl.spawn_sandboxes(api_template, on_stop="sleep 60", on_stop_timeout_s=1)
        slow_id = slow["id"]
        started = time.monotonic()
        ctl.kill_sandbox(slow_id)  # the hook overruns: cut off, and the kill goes on
        assert time.monotonic() - started < 10
        assert slow_id not in {s["id"] for s in ctl.list_sandboxes()}
        slow_id = None
    finally:
        ctl.kill_sandbox(sb["id"])
        if slow_id is not None:
            ctl.kill_sandbox(slow_id)
