"""Sandbox lifetimes over the real app (its reaper running) with a fake VM driver: the
timeout route, expires_at, and each on_timeout action firing at expiry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest

from forkd.client import Controller, ControllerError
from forkd.controller.services import lifecycle
from forkd.controller.settings import Settings
from tests.unit.conftest import Invoke, RecordingTransport, Server

FIRE_WITHIN_SECS = 2.0  # the bound, from expires_at to the action done


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        c.create_snapshot("py", memory_mib=128)
        yield c


def _until(done: Callable[[], Any], within: float) -> float:
    """Seconds until ``done()`` is true; fails after ``within``."""
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < within, "not in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def _gone(ctl: Controller, sid: str) -> bool:
    try:
        ctl.get_sandbox(sid)
    except ControllerError as exc:
        return exc.status == 404
    return False


def test_expires_at_is_reported_and_the_timeout_can_be_extended_or_removed(
    ctl: Controller,
) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=1)[0]
    assert kid["on_timeout"] == "kill"
    at = datetime.fromisoformat(kid["expires_at"]).timestamp()
    assert abs(at - kid["expires_at_unix"]) < 0.01 and 0 < at - time.time() <= 1
    longer = ctl.set_sandbox_timeout(kid["id"], 30)
    assert longer["expires_at_unix"] > time.time() + 29
    time.sleep(2)  # past the first timeout: the extension holds
    assert ctl.get_sandbox(kid["id"])["state"] == "running"
    assert ctl.set_sandbox_timeout(kid["id"], None)["expires_at"] is None


@pytest.mark.parametrize("body", [{"timeout_s": 0}, {"timeout_s": -1}, {"timeout_s": "5"}, {}])
def test_a_bad_timeout_is_a_400_and_changes_nothing(
    ctl: Controller, server: Server, body: dict[str, Any]
) -> None:
    import httpx

    sid = ctl.spawn_sandboxes("py", timeout_s=60)[0]["id"]
    before = ctl.get_sandbox(sid)["expires_at_unix"]
    r = httpx.post(
        f"{server.url}/v1/sandboxes/{sid}/timeout",
        json=body,
        headers={"Authorization": f"Bearer {server.token}"},
    )
    assert r.status_code == 400, r.text
    assert ctl.get_sandbox(sid)["expires_at_unix"] == before


def test_fork_refuses_an_unknown_action_and_two_different_timeouts(ctl: Controller) -> None:
    for kwargs in ({"on_timeout": "sleep"}, {"timeout_s": 5, "timeout_secs": 6}):
        with pytest.raises(ControllerError) as exc:
            ctl._run(ctl._json("POST", "/v1/sandboxes", json_body={"snapshot_tag": "py", **kwargs}))
        assert exc.value.status == 400
    assert ctl.list_sandboxes() == []


def test_on_timeout_kill_fires_in_time(ctl: Controller) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=0.5)[0]
    _until(lambda: _gone(ctl, kid["id"]), 5)
    assert time.time() - kid["expires_at_unix"] < FIRE_WITHIN_SECS


def test_on_timeout_hibernate_hibernates_in_time(ctl: Controller) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=0.5, on_timeout="hibernate")[0]
    _until(lambda: ctl.get_sandbox(kid["id"])["state"] == "hibernated", 5)
    assert time.time() - kid["expires_at_unix"] < FIRE_WITHIN_SECS
    assert ctl.get_sandbox(kid["id"])["expires_at"] is None
    assert ctl.resume_sandbox(kid["id"])["state"] == "running"


def test_on_timeout_hibernate_on_a_disk_without_room_pauses_it_instead(
    ctl: Controller, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.controller.services import disk_room

    monkeypatch.setattr(disk_room, "free_bytes", lambda _path: 64 << 20)
    kid = ctl.spawn_sandboxes("py", timeout_s=0.5, on_timeout="hibernate")[0]
    _until(lambda: ctl.get_sandbox(kid["id"])["state"] == "paused", 5)
    assert ctl.get_sandbox(kid["id"])["expires_at"] is None  # not tried every pass
    assert ctl.resume_sandbox(kid["id"])["state"] == "running"


def test_on_timeout_pause_pauses_and_clears_the_timeout(ctl: Controller) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=0.5, on_timeout="pause")[0]
    t_expiry = kid["expires_at_unix"]
    _until(lambda: ctl.get_sandbox(kid["id"])["state"] == "paused", 5)
    assert time.time() - t_expiry < FIRE_WITHIN_SECS
    info = ctl.get_sandbox(kid["id"])
    assert info["expires_at"] is None
    assert ctl.resume_sandbox(kid["id"])["state"] == "running"


def test_on_timeout_branch_keeps_a_snapshot_and_ends_the_sandbox(
    ctl: Controller, settings: Settings
) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=0.5, on_timeout="branch")[0]
    _until(lambda: ctl.get_sandbox(kid["id"])["state"] == "dead", 5)
    info = ctl.get_sandbox(kid["id"])
    tag = info["timeout_branch"]
    assert tag and ctl.snapshot_info(tag)["branched_from"] == kid["id"]
    assert ctl.spawn_sandboxes(tag)[0]["state"] == "running"  # the state lives on
    audit = (settings.state_dir / "audit.log").read_text().splitlines()
    records = [json.loads(line) for line in audit if '"timeout"' in line]
    assert {
        "event": "timeout",
        "sandbox": kid["id"],
        "on_timeout": "branch",
        "branch": tag,
    }.items() <= records[-1].items()


def test_cli_timeout_and_on_timeout(forkd: Invoke, ctl: Controller) -> None:
    r = forkd(
        "fork",
        "--tag",
        "py",
        "--timeout-secs",
        "60",
        "--on-timeout",
        "pause",
        "--idle-timeout",
        "300",
        "--json",
    )
    assert r.exit_code == 0, r.output
    sid = json.loads(r.stdout)[0]["id"]
    assert ctl.get_sandbox(sid)["on_timeout"] == "pause"
    assert ctl.get_sandbox(sid)["idle_timeout_s"] == 300
    r = forkd("timeout", sid, "120", "--idle", "none", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["idle_timeout_s"] is None
    r = forkd("timeout", sid, "120", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["expires_at_unix"] > time.time() + 119
    r = forkd("timeout", sid, "none")
    assert r.exit_code == 0 and "never" in r.stdout
    assert forkd("timeout", sid, "soon").exit_code == 2


def test_a_branch_that_fails_at_the_timeout_pauses_the_sandbox_instead(
    ctl: Controller, server: Server
) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=60, on_timeout="branch")[0]
    next(vm for vm in server.driver.vms if vm.id == kid["id"]).fail = "capture"
    ctl.set_sandbox_timeout(kid["id"], 0.3)
    _until(lambda: ctl.get_sandbox(kid["id"])["state"] == "paused", 5)
    info = ctl.get_sandbox(kid["id"])
    assert info["timeout_branch"] is None and info["expires_at"] is None  # its state kept


def test_the_timeout_route_changes_on_timeout(ctl: Controller) -> None:
    sid = ctl.spawn_sandboxes("py", timeout_s=60)[0]["id"]
    r = ctl._run(
        ctl._json(
            "POST",
            f"/v1/sandboxes/{sid}/timeout",
            json_body={"timeout_s": 0.3, "on_timeout": "pause"},
        )
    )
    assert r["on_timeout"] == "pause"
    _until(lambda: ctl.get_sandbox(sid)["state"] == "paused", 5)


# ---------------------------------------------------------------- idle timeouts


def _listed(ctl: Controller) -> dict[str, dict[str, Any]]:
    """The sandboxes by id, from the listing, which touches none of them."""
    return {s["id"]: s for s in ctl.list_sandboxes()}


def test_an_idle_sandbox_times_out_and_api_calls_keep_one_alive(ctl: Controller) -> None:
    idle, busy = (s["id"] for s in ctl.spawn_sandboxes("py", n=2, idle_timeout_s=1))
    assert ctl.get_sandbox(idle)["idle_timeout_s"] == 1
    t0 = time.monotonic()
    while idle in _listed(ctl):
        ctl.exec_command(busy, ["echo", "still here"])  # each call is activity
        assert time.monotonic() - t0 < 1 + FIRE_WITHIN_SECS + 1, "the idle one did not go"
        time.sleep(0.2)
    assert time.monotonic() - t0 >= 0.9  # not before its idle timeout
    info = _listed(ctl)[busy]
    assert info["state"] == "running" and info["last_active_at"] is not None


def test_a_listing_is_not_activity_but_process_output_is(ctl: Controller) -> None:
    quiet, chatty = (s["id"] for s in ctl.spawn_sandboxes("py", n=2, idle_timeout_s=1))
    ctl.start_process(chatty, ["count", "100", "0.1"])  # writes a line every 0.1 s
    t0 = time.monotonic()
    while quiet in (listed := _listed(ctl)):
        assert chatty in listed
        assert time.monotonic() - t0 < 1 + FIRE_WITHIN_SECS + 1, "listing kept it alive"
        time.sleep(0.1)
    time.sleep(1.5)  # past the idle timeout with no call to it: its output is activity
    assert _listed(ctl)[chatty]["state"] == "running"


def _listing_hangs(server: Server, sid: str, times: int | None) -> list[int]:
    """The guest of ``sid`` leaves its first ``times`` process listings (all if None)
    unanswered, then answers as before; how many it left so far is the list's one item."""
    vm = next(vm for vm in server.driver.vms if vm.id == sid)
    answer, hung = vm.proc_list, [0]

    async def proc_list() -> Any:
        if times is None or hung[0] < times:
            hung[0] += 1
            await asyncio.sleep(3600)
        return await answer()

    vm.proc_list = proc_list  # type: ignore[method-assign]
    return hung


def test_a_guest_that_never_lists_its_processes_still_times_out_idle(
    ctl: Controller, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "OUTPUT_ANSWER_SECS", 0.2)
    kid = ctl.spawn_sandboxes("py", idle_timeout_s=1)[0]["id"]
    _listing_hangs(server, kid, None)
    # Idle at 1 s, then SILENT_CHECKS passes of one 0.2 s wait each, a second apart (and
    # room for a loaded host: without the bound it would never go).
    _until(lambda: kid not in _listed(ctl), 1 + lifecycle.SILENT_CHECKS * 1.2 + 8)


def test_silences_count_only_within_one_idle_spell(
    ctl: Controller, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "OUTPUT_ANSWER_SECS", 0.2)
    monkeypatch.setattr(lifecycle, "REAP_INTERVAL_SECS", 2.0)  # time to use it between checks
    kid = ctl.spawn_sandboxes("py", idle_timeout_s=1)[0]["id"]
    hung = _listing_hangs(server, kid, None)
    _until(lambda: hung[0] == lifecycle.SILENT_CHECKS - 1, 10)
    ctl.exec_command(kid, ["true"])  # used: a new idle spell starts at its end
    _until(lambda: hung[0] == lifecycle.SILENT_CHECKS, 10)  # the new spell's first silence
    time.sleep(0.6)  # past that check's wait: it alone is not idle
    assert _listed(ctl)[kid]["state"] == "running"
    _until(lambda: kid not in _listed(ctl), 2 * lifecycle.SILENT_CHECKS * 2.2 + 8)


def test_one_unanswered_listing_does_not_make_a_busy_sandbox_idle(
    ctl: Controller, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "OUTPUT_ANSWER_SECS", 0.2)
    kid = ctl.spawn_sandboxes("py", idle_timeout_s=1)[0]["id"]
    ctl.start_process(kid, ["count", "100", "0.1"])  # writes a line every 0.1 s
    _listing_hangs(server, kid, lifecycle.SILENT_CHECKS - 1)  # a loaded guest, late twice
    time.sleep(1 + lifecycle.SILENT_CHECKS * 1.2 + 1)
    assert _listed(ctl)[kid]["state"] == "running"  # its output, once seen, is use


def test_a_request_open_on_a_sandbox_is_use_however_long_it_lasts(
    ctl: Controller, server: Server
) -> None:
    kid = ctl.spawn_sandboxes("py", idle_timeout_s=1)[0]["id"]
    pid = ctl.start_process(kid, ["sleep", "100"])["pid"]  # writes nothing
    url = f"{server.url}/v1/sandboxes/{kid}/processes/{pid}/output"
    auth = {"Authorization": f"Bearer {server.token}"}
    with httpx.stream(
        "GET", url, params={"follow": "true"}, headers=auth, timeout=httpx.Timeout(10, read=3)
    ) as r:
        with contextlib.suppress(httpx.ReadTimeout):  # followed 3 s: silence, no keep-alive
            for _ in r.iter_lines():
                pass
        assert _listed(ctl)[kid]["state"] == "running"  # 3 s with no new call: not idle
    _until(lambda: kid not in _listed(ctl), 1 + FIRE_WITHIN_SECS + 1)  # idle from its end


def test_idle_on_timeout_pause_keeps_the_lifetime_and_idle_can_be_changed(
    ctl: Controller,
) -> None:
    kid = ctl.spawn_sandboxes("py", timeout_s=600, idle_timeout_s=0.5, on_timeout="pause")[0]
    _until(lambda: _listed(ctl)[kid["id"]]["state"] == "paused", 5)
    assert _listed(ctl)[kid["id"]]["expires_at_unix"] == kid["expires_at_unix"]
    ctl.resume_sandbox(kid["id"])
    info = ctl.set_sandbox_timeout(kid["id"], 600, idle_timeout_s=None)
    assert info["idle_timeout_s"] is None
    time.sleep(1.5)
    assert _listed(ctl)[kid["id"]]["state"] == "running"
