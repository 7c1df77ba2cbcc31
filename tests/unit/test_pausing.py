"""Pause and resume over the real app with a fake VM driver: states, refusals, a
branch of a paused sandbox, the SDK and the CLI, and adoption after a restart."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller, ControllerError, Sandbox
from forkd.controller.metrics import Metrics
from forkd.controller.services import Services
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.states import SandboxState, VMState
from tests.unit.conftest import Invoke, RecordingTransport, Server
from tests.unit.fakes import FakeDriver, FakeVM


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


@pytest.fixture
def vm(server: Server, sid: str) -> FakeVM:
    return server.driver.vms[-1]


def _status(call: Any, *args: Any) -> int:
    with pytest.raises(ControllerError) as exc:
        call(*args)
    return exc.value.status


def test_a_paused_sandbox_made_without_auto_resume_answers_nothing_until_resumed(
    ctl: Controller, server: Server, py: str
) -> None:
    sid = ctl.spawn_sandboxes(py, auto_resume=False)[0]["id"]
    vm = server.driver.vms[-1]
    assert ctl.get_sandbox(sid)["auto_resume"] is False
    assert ctl.pause_sandbox(sid)["state"] == "paused"
    assert vm.state == "paused" and ctl.get_sandbox(sid)["state"] == "paused"
    with pytest.raises(ControllerError) as exc:
        ctl.exec_command(sid, ["echo", "hi"])
    assert exc.value.status == 409 and "paused" in exc.value.message
    assert _status(ctl.pause_sandbox, sid) == 409  # already paused: nothing changes
    assert vm.events.count("pause") == 1

    assert ctl.resume_sandbox(sid)["state"] == "running"
    assert vm.events[-2:] == ["resume", "after_resume"]  # the clock is set once it runs
    assert ctl.exec_command(sid, ["echo", "hi"])["stdout"] == "hi\n"
    assert _status(ctl.resume_sandbox, sid) == 409  # not paused
    assert vm.events.count("resume") == 1


def test_unknown_dead_and_failing_sandboxes(ctl: Controller, sid: str, vm: FakeVM) -> None:
    assert _status(ctl.pause_sandbox, "sb-nope-0001") == 404
    assert _status(ctl.resume_sandbox, "sb-nope-0001") == 404
    vm.fail = "pause"
    assert _status(ctl.pause_sandbox, sid) == 500  # QEMU refused; the VM still runs
    assert ctl.get_sandbox(sid)["state"] == "running"
    vm.fail = None
    ctl.pause_sandbox(sid)
    vm.fail = "resume"  # cont fails and QEMU is gone
    assert _status(ctl.resume_sandbox, sid) == 409
    assert ctl.get_sandbox(sid)["state"] == "dead"
    assert _status(ctl.pause_sandbox, sid) == 409


def test_a_branch_of_a_paused_sandbox_takes_it_as_it_is(
    ctl: Controller, sid: str, vm: FakeVM
) -> None:
    ctl.pause_sandbox(sid)
    before = len(vm.events)
    info = ctl.branch_sandbox(sid, tag="held")
    assert info["pause_ms"] == 0 and info["branched_from"] == sid
    assert "pause" not in vm.events[before:] and "resume" not in vm.events[before:]
    assert vm.state == "paused" and ctl.get_sandbox(sid)["state"] == "paused"
    kid = ctl.spawn_sandboxes("held")[0]
    assert kid["state"] == "running"  # a child of the branch runs at once
    assert ctl.resume_sandbox(sid)["state"] == "running"


def test_a_paused_sandbox_can_be_killed(ctl: Controller, sid: str, vm: FakeVM) -> None:
    ctl.pause_sandbox(sid)
    ctl.kill_sandbox(sid)
    assert not vm.alive and _status(ctl.get_sandbox, sid) == 404


def test_sdk_pause_and_resume(ctl: Controller, sid: str, sent: RecordingTransport) -> None:
    sb = Sandbox.connect(sid, controller=ctl)
    assert sb.pause()["state"] == "paused" and sb.info["state"] == "paused"
    assert sent.last.url.path == f"/v1/sandboxes/{sid}/pause"
    assert sb.resume()["state"] == "running"
    assert sent.last.url.path == f"/v1/sandboxes/{sid}/resume"


def test_cli_pause_and_resume(forkd: Invoke, ctl: Controller, sid: str) -> None:
    r = forkd("pause", sid, "sb-nope-0001")
    assert r.exit_code == 1 and f"paused {sid}" in r.stdout
    assert ctl.get_sandbox(sid)["state"] == "paused"
    r = forkd("resume", sid, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"resumed": [sid], "failed": {}}
    assert ctl.get_sandbox(sid)["state"] == "running"


class AdoptingDriver(FakeDriver):
    """Adopts whatever is asked, recording whether it was asked to keep it paused."""

    def __init__(self, machine: Any) -> None:
        super().__init__()
        self.machine = machine
        self.asked: dict[str, bool] = {}

    async def adopt(self, run_dir: Path, paused: bool = False) -> FakeVM:
        from tests.unit.fakes import GuestContents

        self.asked[run_dir.name] = paused
        state = VMState.PAUSED if paused else VMState.RUNNING
        return FakeVM(run_dir.name, self.machine, run_dir.parent, GuestContents(), state=state)


def test_a_restarted_daemon_adopts_a_paused_sandbox_paused(settings: Settings) -> None:
    from forkd.vmm.qemu.argv import MachineConfig

    settings.run_dir.mkdir(parents=True)
    store = Store(settings.state_dir / "forkd.db")
    for sid, state in (("sb-t-0001", SandboxState.PAUSED), ("sb-t-0002", SandboxState.RUNNING)):
        store.add_sandbox(
            SandboxRow(sid, "base", str(settings.run_dir / sid), 1, 1, None, None, state)
        )
    machine = MachineConfig(1, 128, "tcg", Path("k"), Path("i"), Path("r"))
    driver = AdoptingDriver(machine)
    services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), driver)
    asyncio.run(services.lifecycle.adopt_sandboxes())
    assert driver.asked == {"sb-t-0001": True, "sb-t-0002": False}
    assert [store.get_sandbox(s).state for s in ("sb-t-0001", "sb-t-0002")] == [  # type: ignore[union-attr]
        "paused",
        "running",
    ]
    assert services.vms["sb-t-0001"].state == "paused"


def test_a_sandbox_the_daemon_died_forking_is_adopted_running(settings: Settings) -> None:
    """Killed between a fork's claim and its row's update: the next daemon finds the QEMU
    and the row still starting. It runs, so it is running (and can be killed, paused)."""
    from forkd.vmm.qemu.argv import MachineConfig

    settings.run_dir.mkdir(parents=True)
    store = Store(settings.state_dir / "forkd.db")
    store.add_sandbox(
        SandboxRow(
            "sb-t-0003",
            "base",
            str(settings.run_dir / "sb-t-0003"),
            None,
            1,
            None,
            None,
            SandboxState.STARTING,
        )
    )
    machine = MachineConfig(1, 128, "tcg", Path("k"), Path("i"), Path("r"))
    services = Services.create(
        settings, store, Metrics(lambda: 0, lambda: 0), AdoptingDriver(machine)
    )
    asyncio.run(services.lifecycle.adopt_sandboxes())
    row = store.get_sandbox("sb-t-0003")
    assert row is not None and (row.state, row.pid) == (SandboxState.RUNNING, os.getpid())
