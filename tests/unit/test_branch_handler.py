"""The branch handler's ordering and failure table, driven with a fake VM.

The store is the real SQLite store; only the VM is a stand-in, so each
failure can be injected at an exact step.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from forkd.controller.errors import ApiError
from forkd.controller.manager import Manager, Settings
from forkd.controller.metrics import Metrics
from forkd.controller.store import SandboxRow, SnapshotRow, Store
from forkd.errors import SnapshotError, VMError
from forkd.vmm.qemu_argv import MachineConfig


class FakeWriter:
    def __init__(self, vm: FakeVM, dest: Path) -> None:
        self.vm, self.dest = vm, dest
        self.staging = dest.parent / f".{dest.name}.partial-test"
        self.staging.mkdir()
        (self.staging / "memory.bin").write_bytes(b"partial")

    async def capture(self) -> None:
        self.vm.events.append("capture")
        if self.vm.fail == "capture":
            raise SnapshotError(f"disk full while writing snapshot {self.dest.name}")
        if self.vm.fail == "capture-kill":
            self.vm.alive = False
            raise SnapshotError("QEMU died while capturing")
        await asyncio.sleep(self.vm.capture_delay)

    async def commit(self, extra_meta: dict[str, Any] | None = None) -> Path:
        self.vm.events.append("commit")
        m = self.vm.machine
        (self.staging / "memory.bin").write_bytes(b"\0" * (m.memory_mib << 20))
        (self.staging / "vmstate").write_bytes(b"state")
        meta = {"format": 1, "machine": m.to_json(), "vmstate_bytes": 5, **(extra_meta or {})}
        (self.staging / "snapshot.json").write_text(json.dumps(meta))
        self.staging.rename(self.dest)
        return self.dest

    async def abort(self) -> None:
        self.vm.events.append("abort")
        if self.staging.exists():
            for p in self.staging.iterdir():
                p.unlink()
            self.staging.rmdir()


class FakeVM:
    def __init__(self, vm_id: str, machine: MachineConfig) -> None:
        self.id = vm_id
        self.machine = machine
        self.state = "running"
        self.alive = True
        self.fail: str | None = None
        self.capture_delay = 0.0
        self.events: list[str] = []
        self.image = {"name": "python"}

    async def begin_snapshot(self, dest: Path) -> FakeWriter:
        self.events.append("begin")
        return FakeWriter(self, dest)

    async def pause(self) -> None:
        self.events.append("pause")
        if self.fail == "pause":
            raise VMError("stop refused")
        self.state = "paused"

    async def resume(self) -> None:
        self.events.append("resume")
        if self.fail == "resume":
            self.alive = False
            raise VMError("cont failed")
        self.state = "running"

    def is_alive(self) -> bool:
        return self.alive

    async def ping(self) -> dict[str, Any]:
        if not self.alive:
            raise VMError("gone")
        return {"pong": True}

    async def kill(self) -> None:
        self.events.append("kill")
        self.alive = False
        self.state = "dead"


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Manager, FakeVM, list[str]]:
    img = tmp_path / "img"
    img.mkdir()
    for name in ("vmlinuz", "initrd.img", "rootfs.sqfs"):
        (img / name).write_bytes(b"x")
    machine = MachineConfig(1, 1, "tcg", img / "vmlinuz", img / "initrd.img", img / "rootfs.sqfs")
    settings = Settings(
        state_dir=tmp_path, snapshot_root=tmp_path / "snaps", run_dir=tmp_path / "run",
        branch_concurrency=2,
    )  # fmt: skip
    store = Store(tmp_path / "forkd.db")
    manager = Manager(settings, store, Metrics(lambda: 0, lambda: 0))
    store.add_snapshot(SnapshotRow("base", str(tmp_path / "snaps" / "base"), 1, None, None,
                                   None, "python", 1, "ready"))  # fmt: skip
    store.add_sandbox(SandboxRow("sb-t-0001", "base", str(tmp_path / "run" / "x"), 1, 1,
                                 None, None, "running"))  # fmt: skip
    vm = FakeVM("sb-t-0001", machine)
    manager.vms[vm.id] = vm  # type: ignore[assignment]
    real_add = store.add_snapshot

    def add_and_log(row: SnapshotRow) -> None:
        vm.events.append("register")
        real_add(row)

    store.add_snapshot = add_and_log  # type: ignore[method-assign]
    return manager, vm, vm.events


def _on_disk(manager: Manager) -> list[str]:
    return sorted(p.name for p in manager.settings.snapshot_root.iterdir())


def test_order_pause_snapshot_resume_then_register(setup: Any) -> None:
    manager, vm, events = setup
    info = asyncio.run(manager.branch(vm.id, "b1", None))
    assert events == ["begin", "pause", "capture", "resume", "commit", "register"]
    assert info["tag"] == "b1" and info["branched_from"] == vm.id
    assert info["pause_ms"] >= 0 and info["bootable"] is True
    assert vm.state == "running"
    assert _on_disk(manager) == ["b1"]


def test_default_tags_number_per_source(setup: Any) -> None:
    manager, vm, _ = setup
    tags = [asyncio.run(manager.branch(vm.id, None, None))["tag"] for _ in range(2)]
    assert tags == [f"branch-{vm.id}-1", f"branch-{vm.id}-2"]


def test_pause_fails_source_as_it_was(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "pause"
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "b1", None))
    assert exc.value.status == 500 and "stop refused" in exc.value.message
    assert "register" not in events and "resume" not in events and "abort" in events
    assert vm.alive and manager.store.get_sandbox(vm.id).state == "running"
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_snapshot_write_fails_source_resumed_partials_removed(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "capture"
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "b1", None))
    assert exc.value.status == 500 and "disk full" in exc.value.message
    assert events == ["begin", "pause", "capture", "abort", "resume"]
    assert vm.state == "running" and vm.alive
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_qemu_killed_during_snapshot_source_dead_nothing_kept(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "capture-kill"
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "b1", None))
    assert exc.value.status == 500
    assert "resume" not in events
    assert manager.store.get_sandbox(vm.id).state == "dead"
    assert _on_disk(manager) == [] and manager.store.get_snapshot("b1") is None


def test_resume_fails_branch_kept_source_dead(setup: Any) -> None:
    manager, vm, events = setup
    vm.fail = "resume"
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "b1", None))
    assert exc.value.status == 500 and "kept and valid" in exc.value.message
    assert events == ["begin", "pause", "capture", "resume", "commit", "register", "kill"]
    assert manager.store.get_snapshot("b1") is not None
    assert manager.snapshot_info("b1")["bootable"] is True
    assert manager.store.get_sandbox(vm.id).state == "dead"


def test_tag_collision_and_unknown_id_change_nothing(setup: Any) -> None:
    manager, vm, events = setup
    asyncio.run(manager.branch(vm.id, "b1", None))
    events.clear()
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "b1", None))
    assert exc.value.status == 409 and events == []
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch("sb-t-9999", "b2", None))
    assert exc.value.status == 404 and events == []
    assert _on_disk(manager) == ["b1"]


def test_concurrency_cap_and_same_tag_race(setup: Any) -> None:
    manager, vm, _ = setup
    vm.capture_delay = 0.2

    async def race() -> list[Any]:
        return await asyncio.gather(
            manager.branch(vm.id, "same", None),
            manager.branch(vm.id, "same", None),
            return_exceptions=True,
        )

    results = asyncio.run(race())
    statuses = sorted(r.status if isinstance(r, ApiError) else 201 for r in results)
    assert statuses == [201, 409]
    assert _on_disk(manager) == ["same"]

    manager._branches_in_flight = manager.settings.branch_concurrency
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, "other", None))
    assert exc.value.status == 503
    assert manager.store.get_snapshot("other") is None


def test_unsupported_mode_is_refused(setup: Any) -> None:
    manager, vm, events = setup
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.branch(vm.id, None, "incremental"))
    assert exc.value.status == 400 and events == []


def test_cancellation_mid_capture_resumes_and_cleans_up(setup: Any, tmp_path: Path) -> None:
    from forkd.vmm.live_snapshot import snapshot_running

    manager, vm, events = setup

    async def cancelled_capture() -> None:
        events.append("capture")
        raise asyncio.CancelledError

    async def scenario() -> None:
        writer = await vm.begin_snapshot(manager.settings.snapshot_root / "c1")
        writer.capture = cancelled_capture
        vm.begin_snapshot = lambda dest: _ready(writer)
        await snapshot_running(vm, manager.settings.snapshot_root / "c1", {})

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
            *(manager.branch(vm.id, tag, None) for tag in ("one", "two", "three"))
        )

    infos = asyncio.run(three())
    assert sorted(i["tag"] for i in infos) == ["one", "three", "two"]
    step = ["begin", "pause", "capture", "resume", "commit", "register"]
    assert events == step * 3


def test_a_sandbox_still_starting_is_not_killed(setup: Any) -> None:
    manager, vm, events = setup
    manager.store.update_sandbox(vm.id, state="starting")
    with pytest.raises(ApiError) as exc:
        asyncio.run(manager.kill(vm.id))
    assert exc.value.status == 409 and "starting" in exc.value.message
    assert manager.store.get_sandbox(vm.id) is not None and events == []
