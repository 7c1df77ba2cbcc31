"""The branch service's ordering and failure table, driven with a fake VM.

The store, the snapshot files and the services are real; only the VM is a
stand-in (tests/unit/fakes.py), so each failure can be injected at an exact
step. The table is docs/design/branching.md's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from forkd.controller.http_errors import status_of
from forkd.controller.metrics import Metrics
from forkd.controller.models import BranchRequest, SnapshotInfo
from forkd.controller.services import Services
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow
from forkd.errors import ForkdError
from forkd.states import SandboxState, SnapshotStatus
from forkd.vmm.snapshot.files import SnapshotLabels
from tests.unit.fakes import FakeDriver, FakeVM, FakeWriter, GuestContents


@dataclass
class Harness:
    services: Services
    store: Store
    settings: Settings

    async def branch(
        self, sandbox_id: str, tag: str | None, mode: str | None = None
    ) -> SnapshotInfo:
        return await self.services.branches.branch(sandbox_id, BranchRequest(tag=tag, mode=mode))


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Harness, FakeVM, list[str]]:
    from tests.unit.fakes import make_image

    img = make_image(tmp_path / "cache")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    driver = FakeDriver()
    settings = Settings(
        state_dir=tmp_path,
        snapshot_root=tmp_path / "snaps",
        run_dir=tmp_path / "run",
        branch_concurrency=2,
        pool_size=0,
    )
    store = Store(tmp_path / "forkd.db")
    services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), driver)
    from forkd.vmm.qemu.argv import MachineConfig

    machine = MachineConfig(1, 1, "tcg", img / "vmlinuz", img / "initrd.img", img / "rootfs.sqfs")
    store.add_snapshot(
        SnapshotRow(
            "base",
            str(tmp_path / "snaps" / "base"),
            1,
            None,
            None,
            None,
            "python",
            1,
            SnapshotStatus.READY,
        )
    )
    store.add_sandbox(
        SandboxRow(
            "sb-t-0001", "base", str(tmp_path / "run" / "x"), 1, 1, None, None, SandboxState.RUNNING
        )
    )
    vm = FakeVM("sb-t-0001", machine, settings.run_dir, GuestContents())
    services.vms[vm.id] = vm
    real_add = store.add_snapshot

    def add_and_log(row: SnapshotRow, replace: bool = False) -> None:
        vm.events.append("register")
        real_add(row, replace)

    store.add_snapshot = add_and_log  # type: ignore[method-assign]
    return Harness(services, store, settings), vm, vm.events


def _on_disk(manager: Harness) -> list[str]:
    return sorted(p.name for p in manager.settings.snapshot_root.iterdir())


def test_order_pause_snapshot_resume_then_register(setup: Any) -> None:
    manager, vm, events = setup
    info = asyncio.run(manager.branch(vm.id, "b1"))
    assert events == ["begin", "pause", "capture", "resume", "commit", "register"]
    assert info.tag == "b1" and info.branched_from == vm.id
    assert info.pause_ms >= 0 and info.bootable is True
    assert vm.state == "running"
    assert _on_disk(manager) == ["b1"]


def test_default_tags_number_per_source(setup: Any) -> None:
    manager, vm, _ = setup
    tags = [asyncio.run(manager.branch(vm.id, None)).tag for _ in range(2)]
    assert tags == [f"branch-{vm.id}-1", f"branch-{vm.id}-2"]


def test_pause_fails_source_as_it_was(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "pause"
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "b1"))
    assert status_of(exc.value) == 500 and "stop refused" in str(exc.value)
    assert "register" not in events and "resume" not in events and "abort" in events
    assert vm.alive and manager.store.get_sandbox(vm.id).state == "running"
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_snapshot_write_fails_source_resumed_partials_removed(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "capture"
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "b1"))
    assert status_of(exc.value) == 500 and "disk full" in str(exc.value)
    assert events == ["begin", "pause", "capture", "abort", "resume"]
    assert vm.state == "running" and vm.alive
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_qemu_killed_during_snapshot_source_dead_nothing_kept(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "capture-kill"
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "b1"))
    assert status_of(exc.value) == 500
    assert "resume" not in events
    assert manager.store.get_sandbox(vm.id).state == "dead"
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_resume_fails_branch_kept_source_dead(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "resume"
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "b1"))
    assert status_of(exc.value) == 500 and "kept and valid" in str(exc.value)
    assert events == ["begin", "pause", "capture", "resume", "commit", "register", "kill"]
    assert manager.store.get_snapshot("b1") is not None
    assert manager.services.snapshots.info("b1").bootable is True
    assert manager.store.get_sandbox(vm.id).state == "dead"


def test_tag_collision_and_unknown_id_change_nothing(setup: Any) -> None:
    manager, vm, events = setup
    asyncio.run(manager.branch(vm.id, "b1"))
    events.clear()
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "b1"))
    assert status_of(exc.value) == 409 and events == []
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch("sb-t-9999", "b2"))
    assert status_of(exc.value) == 404 and events == []
    assert _on_disk(manager) == ["b1"]


def test_concurrency_cap_and_same_tag_race(setup: Any) -> None:
    manager, vm, _ = setup
    vm.capture_delay = 0.2

    async def race() -> tuple[Any, ...]:
        return await asyncio.gather(
            manager.branch(vm.id, "same"),
            manager.branch(vm.id, "same"),
            return_exceptions=True,
        )

    results = asyncio.run(race())
    statuses = sorted(status_of(r) if isinstance(r, ForkdError) else 201 for r in results)
    assert statuses == [201, 409]
    assert _on_disk(manager) == ["same"]

    manager.services.branches.in_flight = manager.settings.branch_concurrency
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, "other"))
    assert status_of(exc.value) == 503
    assert manager.store.get_snapshot("other") is None


def test_unsupported_mode_is_refused(setup: Any) -> None:
    manager, vm, events = setup
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.branch(vm.id, None, "incremental"))
    assert status_of(exc.value) == 400 and events == []


def test_cancellation_mid_capture_resumes_and_cleans_up(setup: Any, tmp_path: Path) -> None:
    from forkd.vmm.snapshot.live import snapshot_running

    manager, vm, events = setup

    async def cancelled_capture() -> None:
        events.append("capture")
        raise asyncio.CancelledError

    async def scenario() -> None:
        writer = await vm.begin_snapshot(manager.settings.snapshot_root / "c1")
        writer.capture = cancelled_capture
        vm.begin_snapshot = lambda dest: _ready(writer)
        await snapshot_running(vm, manager.settings.snapshot_root / "c1", SnapshotLabels())

    async def _ready(w: FakeWriter) -> FakeWriter:
        return w

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
    assert events[-3:] == ["capture", "abort", "resume"]
    assert vm.state == "running"
    assert _on_disk(manager) == []


def test_two_branches_of_one_sandbox_never_interleave(setup: Any) -> None:
    manager, vm, events = setup
    vm.capture_delay = 0.1

    manager.settings.branch_concurrency = 3  # all three in flight at once

    async def three() -> list[Any]:
        return await asyncio.gather(
            *(manager.branch(vm.id, tag) for tag in ("one", "two", "three"))
        )

    infos = asyncio.run(three())
    assert sorted(i.tag for i in infos) == ["one", "three", "two"]
    step = ["begin", "pause", "capture", "resume", "commit", "register"]
    assert events == step * 3


def test_a_sandbox_still_starting_is_not_killed(setup: Any) -> None:
    manager, vm, events = setup
    with manager.store._transaction() as db:  # as it was before its VM answered
        db.execute("UPDATE sandboxes SET state = 'starting' WHERE id = ?", (vm.id,))
    with pytest.raises(ForkdError) as exc:
        asyncio.run(manager.services.sandboxes.kill(vm.id))
    assert status_of(exc.value) == 409 and "starting" in str(exc.value)
    assert manager.store.get_sandbox(vm.id) is not None and events == []
