"""The pool of QEMU processes started ahead of forks, with a fake in place of QEMU."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from forkd.errors import VMError
from forkd.states import VMState
from forkd.vmm.pool import ForkPool
from forkd.vmm.volumes.disks import Attachment

A, B, C = Path("/snaps/a"), Path("/snaps/b"), Path("/snaps/c")


class FakeVM:
    """A pooled QEMU: what :class:`forkd.vmm.pool.PooledVM` asks of one, and no more
    (``ForkPool[FakeVM]`` below has mypy check it is one)."""

    def __init__(self, vm_id: str, snapshot_dir: Path, volumes: list[Attachment]) -> None:
        self.id = vm_id
        self.snapshot_dir = snapshot_dir
        self.volumes = volumes
        self.alive = True
        self.killed = False
        self.state = VMState.INCOMING
        self.fail_prewarm = False
        self.private_mib = 40

    def memory_usage(self) -> dict[str, int]:
        return {"private": self.private_mib << 20}

    async def prewarm(self) -> None:
        if self.fail_prewarm:
            self.killed = True  # as VM.prewarm does when the restore fails
            raise VMError("the restore failed")
        self.state = VMState.WARM

    def is_alive(self) -> bool:
        return self.alive and not self.killed

    async def kill(self) -> None:
        self.killed = True


class Spawner:
    """Stands for ``VM.spawn_incoming``; records every VM and every call's arguments."""

    def __init__(self) -> None:
        self.vms: list[FakeVM] = []
        self.calls: list[dict[str, Any]] = []
        self.fail_for: set[Path] = set()
        self.gate: asyncio.Event | None = None  # when set, spawning waits for it
        self.volumes: dict[Path, list[Attachment]] = {}

    async def __call__(self, snapshot_dir: Path, **kw: Any) -> FakeVM:
        self.calls.append({"snapshot_dir": snapshot_dir, **kw})
        if self.gate is not None:
            await self.gate.wait()
        if snapshot_dir in self.fail_for:
            raise VMError("QEMU would not start")
        vm = FakeVM(kw["vm_id"], snapshot_dir, list(self.volumes.get(snapshot_dir, [])))
        self.vms.append(vm)
        return vm


def _pool(spawner: Spawner, demand: int | None = None, **kw: Any) -> ForkPool[FakeVM]:
    """A pool whose snapshots A, B and C each had a request for ``demand`` children
    (default: as many as ``per_snapshot``)."""
    ids = iter(range(1, 1000))
    pool = ForkPool(Path("/run"), new_id=lambda: f"sb-{next(ids)}", spawn=spawner, **kw)
    for snap in (A, B, C):
        pool.record_demand(snap, demand or pool.per_snapshot)
    return pool


async def _settle() -> None:
    for _ in range(5):  # let background kills run
        await asyncio.sleep(0)


def test_refill_starts_per_snapshot_processes_and_take_hands_them_out() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=2, detach=True)
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 2
        assert spawner.calls[0] == {
            "snapshot_dir": A,
            "run_root": Path("/run"),
            "vm_id": "sb-1",
            "detach": True,
        }
        first, second = pool.take(A), pool.take(A)
        assert {first, second} == set(spawner.vms)
        assert pool.take(A) is None  # empty until refilled
        assert pool.take(B) is None  # never filled
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 2 and len(spawner.vms) == 4
        await pool.close()

    asyncio.run(scenario())


def test_take_skips_and_kills_processes_that_died() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=2)
        pool.refill(A)
        await pool.wait_filled(A)
        dead, live = spawner.vms
        dead.alive = False
        assert pool.take(A) is live
        await _settle()
        assert dead.killed and not live.killed

    asyncio.run(scenario())


def test_the_least_recently_used_snapshot_is_evicted() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=1, max_snapshots=2)
        for snap in (A, B):
            pool.refill(snap)
            await pool.wait_filled(snap)
        pool.refill(A)  # A is now the most recent
        pool.refill(C)
        await pool.wait_filled(C)
        await _settle()
        by_snap = {vm.snapshot_dir: vm for vm in spawner.vms}
        assert by_snap[B].killed
        assert not by_snap[A].killed and not by_snap[C].killed
        assert pool.take(B) is None and pool.take(A) is by_snap[A]
        await pool.close()

    asyncio.run(scenario())


def test_drop_close_and_drop_using_kill_what_waits() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        spawner.volumes[B] = [Attachment("data", "/data", True, ("/v/data/base.img",))]
        pool = _pool(spawner, per_snapshot=1)
        for snap in (A, B, C):
            pool.refill(snap)
            await pool.wait_filled(snap)
        by_snap = {vm.snapshot_dir: vm for vm in spawner.vms}
        await pool.drop_using("data")
        assert by_snap[B].killed and not by_snap[A].killed
        await pool.drop(A)
        assert by_snap[A].killed and pool.take(A) is None
        await pool.close()
        assert all(vm.killed for vm in spawner.vms)
        assert pool.waiting() == 0 and pool.all_vms() == []

    asyncio.run(scenario())


def test_dropping_a_snapshot_while_its_qemu_starts_cancels_the_start() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        spawner.gate = asyncio.Event()  # QEMU never finishes starting
        pool = _pool(spawner, per_snapshot=1)
        pool.refill(A)
        await asyncio.sleep(0)
        assert pool.filling() and len(spawner.calls) == 1
        await pool.drop(A)
        assert not pool.filling()
        spawner.gate.set()
        await _settle()
        assert spawner.vms == [] and pool.take(A) is None

    asyncio.run(scenario())


def test_a_failed_start_leaves_the_pool_empty_not_broken() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        spawner.fail_for.add(A)
        pool = _pool(spawner, per_snapshot=2)
        pool.refill(A)
        await pool.wait_filled(A)  # no exception: the fork will restore as usual
        assert pool.take(A) is None and len(spawner.calls) == 1
        spawner.fail_for.clear()
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 2
        await pool.close()

    asyncio.run(scenario())


def test_a_pool_of_size_zero_starts_nothing() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=0)
        pool.refill(A)
        await pool.wait_filled(A)
        assert spawner.calls == [] and pool.take(A) is None

    asyncio.run(scenario())


def test_a_warm_pool_restores_ahead_and_a_failed_warm_up_is_not_handed_out() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=2, warm=True)
        pool.refill(A)
        await pool.wait_filled(A)
        assert [vm.state for vm in spawner.vms] == [VMState.WARM, VMState.WARM]
        taken = pool.take(A)
        assert taken is not None and taken.state == VMState.WARM
        original = FakeVM.prewarm

        async def failing(self: FakeVM) -> None:
            self.fail_prewarm = True
            await original(self)

        FakeVM.prewarm = failing  # type: ignore[method-assign]
        try:
            pool.refill(A)
            await pool.wait_filled(A)
        finally:
            FakeVM.prewarm = original  # type: ignore[method-assign]
        assert pool.waiting() == 1 and spawner.vms[-1].killed  # the failed one is gone
        assert pool.take(A) is spawner.vms[1]
        await pool.close()

    asyncio.run(scenario())


def test_the_pool_follows_recent_demand_up_to_its_maximum() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = ForkPool(Path("/run"), per_snapshot=5, spawn=spawner, new_id=lambda: "sb-x")
        pool.refill(A)  # no request seen yet: one
        await pool.wait_filled(A)
        assert pool.waiting() == 1
        pool.record_demand(A, 3)
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 3
        pool.record_demand(A, 50)  # more than the maximum
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 5
        await pool.close()

    asyncio.run(scenario())


def test_the_pool_stays_under_its_memory_cap() -> None:
    async def scenario() -> None:
        spawner = Spawner()
        pool = _pool(spawner, per_snapshot=8, memory_cap_mib=130)
        pool.refill(A)
        await pool.wait_filled(A)
        assert pool.waiting() == 3  # 40 MiB each: a fourth would pass 130
        pool.refill(B)
        await pool.wait_filled(B)
        assert pool.waiting() == 3  # the cap is for all snapshots together
        await pool.close()

    asyncio.run(scenario())
