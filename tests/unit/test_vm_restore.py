"""VM.restore of a damaged snapshot: refused naming the file, before any QEMU starts.

The snapshot is a real directory written by the fake VM driver's snapshot
writer; ``launch.prepare_runtime`` and ``launch.spawn`` are replaced, so a
restore that got as far as starting QEMU fails here instead of booting one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from forkd.errors import SnapshotError
from forkd.vmm import launch
from forkd.vmm.qemu_argv import MachineConfig
from forkd.vmm.vm import VM
from tests.unit.fakes import FakeVM, Guest, make_image


class QemuStarted(Exception):
    pass


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The VM ids restore got as far as giving a run directory and a QEMU."""
    ids: list[str] = []

    def prepare_runtime(run_root: Path, vm_id: str) -> object:
        ids.append(vm_id)
        raise QemuStarted(vm_id)

    monkeypatch.setattr(launch, "prepare_runtime", prepare_runtime)
    monkeypatch.setattr(launch, "spawn", lambda *a, **kw: pytest.fail("QEMU started"))
    return ids


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """An intact snapshot of a 4 MiB fake VM."""
    image = make_image(tmp_path / "cache")
    machine = MachineConfig(
        4, 1, "tcg", image / "vmlinuz", image / "initrd.img", image / "rootfs.sqfs"
    )
    vm = FakeVM("tpl", machine, tmp_path / "tpl-run", Guest())
    return asyncio.run(vm.snapshot(tmp_path / "snap"))


def restore(snapshot: Path, run_root: Path) -> None:
    asyncio.run(VM.restore(snapshot, run_root=run_root, vm_id="child"))


def test_an_intact_snapshot_gets_as_far_as_starting_qemu(
    snapshot: Path, tmp_path: Path, started: list[str]
) -> None:
    with pytest.raises(QemuStarted):
        restore(snapshot, tmp_path / "run")
    assert started == ["child"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "memory.bin").unlink(), r"memory\.bin is missing"),
        (lambda d: os.truncate(d / "memory.bin", 1 << 20), r"memory\.bin is corrupt"),
        (lambda d: (d / "vmstate").unlink(), r"vmstate is missing"),
    ],
    ids=["missing-memory-bin", "truncated-memory-bin", "missing-vmstate"],
)
def test_a_damaged_snapshot_is_named_before_qemu_starts(
    snapshot: Path,
    tmp_path: Path,
    started: list[str],
    damage: Callable[[Path], None],
    message: str,
) -> None:
    damage(snapshot)
    with pytest.raises(SnapshotError, match=message) as info:
        restore(snapshot, tmp_path / "run")
    assert str(snapshot) in str(info.value)
    assert started == []
    assert not (tmp_path / "run").exists()
