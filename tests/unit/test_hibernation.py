"""Hibernate and wake over the real app with a fake VM driver: the states, what is
left on disk, refusals, a branch of a hibernated sandbox, expiry, kill, the SDK
and CLI, and a restarted daemon."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from forkd.client import Controller, ControllerError, Sandbox
from forkd.controller.metrics import Metrics
from forkd.controller.services import Services
from forkd.controller.services.hibernated_files import NETWORK_FILE, HibernatedFiles
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from tests.unit.conftest import Invoke, RecordingTransport, Server
from tests.unit.fakes import FakeDriver, FakeVM


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


@pytest.fixture
def vm(server: Server, sid: str) -> FakeVM:
    return server.driver.vms[-1]


def _status(call: object, *args: object, **kw: object) -> int:
    with pytest.raises(ControllerError) as exc:
        call(*args, **kw)  # type: ignore[operator]
    return exc.value.status


def _sleeping(settings: Settings, sid: str) -> list[str]:
    return sorted(
        d.name for d in settings.snapshot_root.iterdir() if HibernatedFiles.owner(d.name) == sid
    )


def test_hibernate_ends_the_vm_and_resume_wakes_it_under_the_same_id(
    ctl: Controller, server: Server, settings: Settings, sid: str, vm: FakeVM
) -> None:
    ctl.write_file(sid, "/tmp/note", b"kept")
    info = ctl.pause_sandbox(sid, hibernate=True)
    assert info["state"] == "hibernated" and info["pid"] is None
    assert not vm.alive and vm.events[-1] == "kill"  # its QEMU is gone
    assert _sleeping(settings, sid) == [f".hibernated.{sid}.1"]
    assert _status(ctl.pause_sandbox, sid) == 409
    assert _status(ctl.pause_sandbox, sid, hibernate=True) == 409  # already hibernated
    assert [s["id"] for s in ctl.list_sandboxes(state="hibernated")] == [sid]

    woken = ctl.resume_sandbox(sid)
    assert woken["state"] == "running" and woken["id"] == sid
    new_vm = server.driver.vms[-1]
    assert new_vm is not vm and new_vm.id == sid and new_vm.alive
    assert server.driver.restore_kwargs[-1]["hostname"] == sid
    assert ctl.read_file(sid, "/tmp/note") == b"kept"  # its state came back
    assert _status(ctl.resume_sandbox, sid) == 409  # running: nothing to resume
    # The woken VM maps that state: it stays until the next hibernation.
    assert _sleeping(settings, sid) == [f".hibernated.{sid}.1"]
    ctl.pause_sandbox(sid, hibernate=True)
    assert _sleeping(settings, sid) == [f".hibernated.{sid}.2"]
    ctl.kill_sandbox(sid)
    assert _sleeping(settings, sid) == []


def test_a_paused_sandbox_hibernates_without_a_second_pause(
    ctl: Controller, sid: str, vm: FakeVM
) -> None:
    ctl.pause_sandbox(sid)
    before = len(vm.events)
    assert ctl.pause_sandbox(sid, hibernate=True)["state"] == "hibernated"
    assert "pause" not in vm.events[before:] and "resume" not in vm.events[before:]


def test_a_failed_hibernation_leaves_the_sandbox_running(
    ctl: Controller, settings: Settings, sid: str, vm: FakeVM
) -> None:
    vm.fail = "capture"
    assert _status(ctl.pause_sandbox, sid, hibernate=True) == 500
    assert ctl.get_sandbox(sid)["state"] == "running" and vm.state == "running"
    assert vm.alive and _sleeping(settings, sid) == []
    assert not list(settings.snapshot_root.glob(".*.partial-*"))
    vm.fail = None
    assert ctl.exec_command(sid, ["echo", "hi"])["stdout"] == "hi\n"


def test_a_hibernation_the_disk_cannot_hold_is_refused_before_anything_is_written(
    ctl: Controller, settings: Settings, sid: str, vm: FakeVM, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.controller.services import disk_room

    monkeypatch.setattr(disk_room, "free_bytes", lambda _path: 1000 << 20)  # under 1 GiB
    with pytest.raises(ControllerError) as refused:
        ctl.pause_sandbox(sid, hibernate=True)
    assert refused.value.status == 500
    said = str(refused.value)
    assert "needs 1024 MiB free" in said and "--disk-reserve" in said and "1000 MiB" in said
    assert vm.state == "running" and "pause" not in vm.events  # not even paused
    assert ctl.get_sandbox(sid)["state"] == "running" and _sleeping(settings, sid) == []


def test_a_failed_wake_leaves_it_hibernated(
    ctl: Controller, server: Server, settings: Settings, sid: str
) -> None:
    from forkd.errors import VMError

    ctl.pause_sandbox(sid, hibernate=True)
    server.driver.fail_restore = VMError("QEMU would not start")
    assert _status(ctl.resume_sandbox, sid) == 500
    assert ctl.get_sandbox(sid)["state"] == "hibernated"
    assert _sleeping(settings, sid) == [f".hibernated.{sid}.1"]
    server.driver.fail_restore = None
    assert ctl.resume_sandbox(sid)["state"] == "running"


def test_a_branch_of_a_hibernated_sandbox_is_its_state_on_disk(
    ctl: Controller, server: Server, sid: str, settings: Settings
) -> None:
    ctl.write_file(sid, "/tmp/at", b"hibernation")
    ctl.pause_sandbox(sid, hibernate=True)
    restores = len(server.driver.restore_kwargs)
    info = ctl.branch_sandbox(sid, tag="asleep")
    assert info["pause_ms"] == 0 and info["branched_from"] == sid
    assert len(server.driver.restore_kwargs) == restores  # no VM was started for it
    assert not (settings.state_dir / info["dir"] / NETWORK_FILE).exists()
    kid = ctl.spawn_sandboxes("asleep")[0]
    assert ctl.read_file(kid["id"], "/tmp/at") == b"hibernation"
    assert ctl.get_sandbox(sid)["state"] == "hibernated"


def test_a_hibernated_sandbox_has_no_timeout_and_resume_sets_one(ctl: Controller, sid: str) -> None:
    ctl.set_sandbox_timeout(sid, 300)
    assert ctl.pause_sandbox(sid, hibernate=True)["expires_at"] is None
    info = ctl.resume_sandbox(sid, timeout_s=60)
    assert 50 < info["expires_at_unix"] - time.time() <= 60


def test_sdk_and_cli_hibernate(
    ctl: Controller,
    sid: str,
    sent: RecordingTransport,
    forkd: Invoke,
) -> None:
    sb = Sandbox.connect(sid, controller=ctl)
    assert sb.hibernate()["state"] == "hibernated"
    assert json.loads(sent.last.content) == {"hibernate": True}
    assert sb.resume()["state"] == "running"
    r = forkd("pause", "--hibernate", sid, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"hibernated": [sid], "failed": {}}
    r = forkd("resume", sid)
    assert r.exit_code == 0 and ctl.get_sandbox(sid)["state"] == "running"


def test_a_restarted_daemon_keeps_a_hibernated_sandbox(
    ctl: Controller, server: Server, settings: Settings, sid: str
) -> None:
    ctl.pause_sandbox(sid, hibernate=True)
    orphan = settings.snapshot_root / ".hibernated.sb-gone-0001.1"
    orphan.mkdir()
    store = Store(settings.state_dir / "forkd.db")
    try:
        services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), FakeDriver())
        services.lifecycle.reconcile_snapshots()
        asyncio.run(services.lifecycle.adopt_sandboxes())
        assert store.get_sandbox(sid).state == "hibernated"  # type: ignore[union-attr]
        assert not orphan.exists()  # its sandbox is gone: so is its state
        assert _sleeping(settings, sid) == [f".hibernated.{sid}.1"]
    finally:
        store.close()


def test_pause_hibernate_and_resume_are_events(ctl: Controller, sid: str) -> None:
    ctl.pause_sandbox(sid)
    ctl.pause_sandbox(sid, hibernate=True)
    ctl.resume_sandbox(sid)
    seen = []
    for event in ctl.events(sandbox_id=sid, since=0):
        seen.append(event.type)
        if event.type == "resumed":
            break
    assert seen == ["created", "paused", "hibernated", "resumed"]


def test_auto_resume_and_evictable_change_after_the_fork_from_the_sdk_and_the_cli(
    ctl: Controller,
    sid: str,
    forkd: Invoke,
) -> None:
    sb = Sandbox(sandbox_id=sid, controller=ctl)
    assert sb.update(auto_resume=False)["auto_resume"] is False
    ctl.pause_sandbox(sid, hibernate=True)
    assert _status(ctl.exec_command, sid, ["true"]) == 409  # no longer woken by a request
    res = forkd("update", sid, "--auto-resume", "--no-evictable")
    assert res.exit_code == 0, res.output
    assert "evictable false, auto_resume true" in res.stdout
    assert ctl.exec_command(sid, ["echo", "up"])["stdout"] == "up\n"  # woken again
    assert forkd("update", sid).exit_code != 0  # nothing to change: said, not sent
