"""The reaper and the daemon's stop over the fake VM driver: a VM that hangs holds up no other.

Sandboxes are real registry rows and fake VMs. A wedged VM is a fake whose
``is_alive`` blocks its thread (as a read of ``/proc`` can on a process stuck
in the kernel) or whose ``kill`` or ``release`` never returns.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from forkd.controller.metrics import Metrics
from forkd.controller.services import Services, lifecycle
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.states import SandboxState
from forkd.vmm.qemu.argv import MachineConfig
from tests.unit.fakes import FakeDriver, FakeVM, GuestContents, make_image

HANG_SECS = 5.0  # a "hang" ends after this, so code that waits it out fails instead of hanging


@dataclass
class Harness:
    services: Services
    store: Store
    settings: Settings
    machine: MachineConfig
    gate: threading.Event  # set at teardown: releases every blocked is_alive

    @property
    def lifecycle(self) -> lifecycle.Lifecycle:
        return self.services.lifecycle

    def sandbox(self, sid: str, *, expires: float | None = None, alive: bool = True) -> FakeVM:
        self.store.add_sandbox(
            SandboxRow(
                sid,
                "base",
                str(self.settings.run_dir / sid),
                1,
                1,
                None,
                expires,
                SandboxState.RUNNING,
            )
        )
        vm = FakeVM(sid, self.machine, self.settings.run_dir, GuestContents())
        vm.alive = alive
        self.services.vms[sid] = vm
        return vm

    def wedge_is_alive(self, vm: FakeVM) -> None:
        vm.is_alive = lambda: self.gate.wait(HANG_SECS)  # type: ignore[method-assign]

    def state(self, sid: str) -> str | None:
        row = self.store.get_sandbox(sid)
        return None if row is None else row.state


async def _hang(*_: Any) -> None:
    await asyncio.sleep(HANG_SECS)


@pytest.fixture
def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    img = make_image(tmp_path / "cache")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lifecycle, "PROBE_SECS", 0.2)
    monkeypatch.setattr(lifecycle, "REAP_CHECK_SECS", 0.5)
    monkeypatch.setattr(lifecycle, "STOP_VM_SECS", 0.5)
    settings = Settings(
        state_dir=tmp_path,
        snapshot_root=tmp_path / "snaps",
        run_dir=tmp_path / "run",
        pool_size=0,
        network="user",
    )
    store = Store(tmp_path / "forkd.db")
    services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), FakeDriver())
    machine = MachineConfig(1, 1, "tcg", img / "vmlinuz", img / "initrd.img", img / "rootfs.sqfs")
    harness = Harness(services, store, settings, machine, threading.Event())
    yield harness
    harness.gate.set()


def _timed(coro: Any) -> float:
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(coro, HANG_SECS * 2))
    return time.monotonic() - started


def test_a_wedged_is_alive_does_not_stop_dead_or_expired_sandboxes_being_reaped(h: Harness) -> None:
    wedged = h.sandbox("sb-wedged")
    h.wedge_is_alive(wedged)
    dead = h.sandbox("sb-dead", alive=False)
    expired = h.sandbox("sb-expired", expires=time.time() - 1)
    h.sandbox("sb-fine")

    took = _timed(h.lifecycle.reap_once())

    assert took < 2  # the probe's timeout, not the hang
    assert h.state("sb-dead") == "dead" and "kill" in dead.events
    assert h.state("sb-expired") is None and "kill" in expired.events
    assert h.state("sb-wedged") == "running"  # not judged on a probe that never answered
    assert h.state("sb-fine") == "running"


def test_a_kill_that_hangs_does_not_stop_the_others(h: Harness) -> None:
    stuck = h.sandbox("sb-stuck", expires=time.time() - 1)
    stuck.kill = _hang  # type: ignore[method-assign]
    expired = h.sandbox("sb-expired", expires=time.time() - 1)
    dead = h.sandbox("sb-dead", alive=False)

    took = _timed(h.lifecycle.reap_once())

    assert took < 2  # REAP_CHECK_SECS
    assert h.state("sb-expired") is None and "kill" in expired.events
    assert h.state("sb-dead") == "dead" and "kill" in dead.events
    assert h.state("sb-stuck") == "running"  # its row stays: the next pass retries


def test_the_reaper_loop_goes_on_while_one_check_is_stuck(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "REAP_INTERVAL_SECS", 0.05)
    monkeypatch.setattr(lifecycle, "REAP_CHECK_SECS", 30.0)  # stuck for the whole test
    stuck = h.sandbox("sb-stuck", expires=time.time() - 1)
    kills: list[float] = []

    async def hang_counted(*_: Any) -> None:
        kills.append(time.monotonic())
        await _hang()

    stuck.kill = hang_counted  # type: ignore[method-assign]
    later = h.sandbox("sb-later")

    async def main() -> None:
        lc = h.lifecycle
        lc._reaper = asyncio.create_task(lc._reap_loop())
        await asyncio.sleep(0.3)  # the stuck check is in flight by now
        assert "sb-stuck" in lc._checks
        later.alive = False  # dies while the other check is stuck
        for _ in range(40):
            await asyncio.sleep(0.05)
            if h.state("sb-later") == "dead":
                break
        assert h.state("sb-later") == "dead"
        # The stuck sandbox is checked once at a time, not again on every pass.
        # (sb-later may be in _checks too: dead rows get a quick check each pass.)
        assert "sb-stuck" in lc._checks and len(kills) == 1
        await lc.stop()

    assert _timed(main()) < 4


def test_stop_lets_go_of_every_vm_together_while_some_releases_hang(h: Harness) -> None:
    for i in range(3):
        h.sandbox(f"sb-stuck-{i}").release = _hang  # type: ignore[method-assign]
    others = [h.sandbox(f"sb-{i}") for i in range(3)]

    took = _timed(h.lifecycle.stop())

    assert took < 1.2  # STOP_VM_SECS once (0.5 s): the VMs are let go of together
    assert all(vm.events == ["release"] for vm in others)
    assert h.services.vms == {}


def test_stop_kills_every_vm_together_while_some_kills_hang(h: Harness) -> None:
    h.settings.kill_on_exit = True
    for i in range(3):
        h.sandbox(f"sb-stuck-{i}").kill = _hang  # type: ignore[method-assign]
    others = [h.sandbox(f"sb-{i}") for i in range(3)]

    took = _timed(h.lifecycle.stop())

    assert took < 1.2
    assert all(vm.events == ["kill"] for vm in others)
    assert all(h.state(vm.id) is None for vm in others)


def test_a_probe_that_never_returns_holds_up_neither_the_loop_nor_other_probes() -> None:
    probes = lifecycle.Probes(threads=2)
    gate = threading.Event()

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await probes.run(lambda: gate.wait(HANG_SECS), 0.1)
        assert await probes.run(lambda: 42, 1.0) == 42  # the other thread answers
        with pytest.raises(ZeroDivisionError):
            await probes.run(lambda: 1 // 0, 1.0)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        probes.close()
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("forkd-probe"))
