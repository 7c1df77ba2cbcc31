"""The daemon's warm pool over the real app with a fake VM driver: a fork takes a QEMU
restored ahead of time and claims it; one whose claim fails is undone like any fork."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from forkd.client import Controller, ControllerError
from forkd.controller.settings import Settings
from tests.unit.conftest import RecordingTransport, Server


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.pool_size = 1
    return settings


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def _pooled(server: Server) -> list[str]:
    """Ids of the pool's VMs once one waits, warm."""
    deadline = time.monotonic() + 5
    while True:
        warm = [vm.id for vm in server.driver.vms if vm.state == "warm" and vm.alive]
        if warm:
            return warm
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.02)


def test_a_fork_claims_a_warm_pooled_vm(ctl: Controller, server: Server, py: str) -> None:
    ctl.spawn_sandboxes(py)  # the first fork of a snapshot fills its pool
    [waiting] = _pooled(server)
    vm = next(v for v in server.driver.vms if v.id == waiting)
    assert vm.events == ["prewarm"]  # restored and stopped, in the background
    kid = ctl.spawn_sandboxes(py)[0]
    assert kid["id"] == waiting and kid["state"] == "running"
    assert vm.events == ["prewarm", "claim"]
    assert ctl.exec_command(kid["id"], ["echo", "hi"])["stdout"] == "hi\n"


def test_a_failed_claim_is_undone_like_any_fork(ctl: Controller, server: Server, py: str) -> None:
    ctl.spawn_sandboxes(py)
    [waiting] = _pooled(server)
    vm = next(v for v in server.driver.vms if v.id == waiting)
    vm.fail = "claim"
    before = {s["id"] for s in ctl.list_sandboxes()}
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes(py)
    assert exc.value.status == 500
    assert {s["id"] for s in ctl.list_sandboxes()} == before  # nothing kept
