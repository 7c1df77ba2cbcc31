"""Snapshots that go wrong: a QEMU killed mid-snapshot, damaged snapshot files.

A file missing or cut short is refused before QEMU starts:
tests/unit/test_vm_restore.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from forkd.errors import SnapshotError, VMError
from forkd.vmm.snapshot import live as live_snapshot
from forkd.vmm.snapshot import live_copy, memory, write_tracking

from .conftest import Fleet

pytestmark = pytest.mark.integration


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_kill_9_between_pause_and_capture(fleet: Fleet, base_snapshot: Path) -> None:
    child = fleet.fork(base_snapshot)
    dest = fleet.snap_root / "killed-a"
    before = _leftovers(fleet.snap_root)

    async def scenario() -> None:
        writer = await child.begin_snapshot(dest)
        await child.pause()
        os.kill(child.pid, signal.SIGKILL)
        try:
            await writer.capture()
        finally:
            await writer.abort()

    with pytest.raises(SnapshotError, match="died"):
        fleet.loop.run(scenario())
    assert not dest.exists()
    assert _leftovers(fleet.snap_root) == before
    assert not child.is_alive()
    assert child.state == "dead"


@pytest.mark.parametrize("live", [False, True], ids=["full", "live"])
def test_kill_9_while_copying_memory(
    fleet: Fleet, base_snapshot: Path, monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    """QEMU dies while its RAM is being copied in the pause, in either mode."""
    child = fleet.fork(base_snapshot)
    dest = fleet.snap_root / "killed-b"
    before = _leftovers(fleet.snap_root)
    if live:
        if write_tracking.problem():  # live is then taken as full: the other case
            pytest.skip(f"this host cannot track writes: {write_tracking.problem()}")
        real_capture = live_copy.LiveCopy.capture

        def capture_then_die(self, defer):
            os.kill(self.region.pid, signal.SIGKILL)
            time.sleep(0.2)
            return real_capture(self, defer)

        monkeypatch.setattr(live_copy.LiveCopy, "capture", capture_then_die)
    else:
        real_dump = memory.dump_written_pages

        def dump_then_die(region, out_fd, **kw):
            os.kill(region.pid, signal.SIGKILL)
            time.sleep(0.2)
            return real_dump(region, out_fd, **kw)

        monkeypatch.setattr(memory, "dump_written_pages", dump_then_die)
    started = time.monotonic()
    with pytest.raises(SnapshotError, match=r"died while capturing the snapshot killed-b"):
        fleet.loop.run(live_snapshot.write(child, dest, live=live))
    assert time.monotonic() - started < 30
    assert not dest.exists()
    assert _leftovers(fleet.snap_root) == before


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_garbage_vmstate_fails_fast_naming_it(
    fleet: Fleet, base_snapshot: Path, tmp_path: Path
) -> None:
    snap = _copy(base_snapshot, tmp_path / "s")
    vmstate = snap / "vmstate"
    vmstate.write_bytes(os.urandom(vmstate.stat().st_size))
    runs_before = _leftovers(fleet.run_root)
    started = time.monotonic()
    with pytest.raises((SnapshotError, VMError), match=r"vmstate"):
        fleet.fork(snap, timeout=20)
    assert time.monotonic() - started < 25
    assert _leftovers(fleet.run_root) == runs_before  # the failed VM is gone


def test_garbage_memory_fails_within_timeout_naming_it(
    fleet: Fleet, base_snapshot: Path, tmp_path: Path
) -> None:
    snap = _copy(base_snapshot, tmp_path / "s")
    mem = snap / "memory.bin"
    with mem.open("r+b") as f:  # scribble over the kernel's low memory
        f.seek(1 << 20)
        f.write(os.urandom(16 << 20))
    started = time.monotonic()
    with pytest.raises((SnapshotError, VMError), match=r"memory\.bin"):
        fleet.fork(snap, timeout=10)
    assert time.monotonic() - started < 20
