"""What a dead daemon's import left, swept by the next one (issue 35): staging directories
and temporary blob files of processes now gone are removed, those of live ones and
recent unmarked ones kept; a worker whose parent is gone is killed, one whose parent
lives is not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forkd import paths, processes
from forkd.image_import import leftovers
from forkd.processes import Holder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path))
    (tmp_path / "images").mkdir()
    (tmp_path / "blobs" / "tmp").mkdir(parents=True)
    return tmp_path


def dead_mark() -> str:
    """The mark of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    me = Holder.of(proc.pid)
    proc.wait()
    assert me is not None
    return me.mark()


def test_what_dead_processes_left_is_removed_and_the_rest_kept(cache: Path) -> None:
    dead = dead_mark()
    images, tmp = paths.images_dir(), paths.blobs_dir() / "tmp"
    gone = [
        images / f".staging-oci-1-{dead}abc",
        tmp / f"{dead}0011.load.tar",
        images / ".removing-oci-2-00",
    ]
    kept = [
        images / f".staging-oci-3-{processes.mark()}abc",
        tmp / f"{processes.mark()}22.blob",
        images / ".staging-unmarked-recent",
        images / "oci-4-0000",
    ]
    old = images / ".staging-unmarked-old"
    for path in (*gone, *kept, old):
        if path.suffix:
            path.write_bytes(b"x")
        else:
            path.mkdir()
            (path / "inside").write_bytes(b"x")
    os.utime(old, (time.time() - 2 * leftovers.UNMARKED_STALE_SECS,) * 2)
    swept = leftovers.sweep()
    assert swept.removed == len(gone) + 1
    assert not any(p.exists() for p in (*gone, old))
    assert all(p.exists() for p in kept)


def test_a_worker_whose_parent_is_gone_is_killed(cache: Path) -> None:
    orphan = subprocess.Popen(["sleep", "60"])
    adopted = subprocess.Popen(["sleep", "60"])
    try:
        records = cache / leftovers.WORKERS
        records.mkdir()
        for proc, parent in ((orphan, dead_mark()), (adopted, processes.mark())):
            me = Holder.of(proc.pid)
            assert me is not None
            (records / f"{me.mark()}worker").write_text(parent)
        assert leftovers.sweep().workers_killed == 1
        assert orphan.wait(5) == -9
        assert adopted.poll() is None  # its import still runs
        assert len(os.listdir(records)) == 1
    finally:
        for proc in (orphan, adopted):
            proc.kill()
            proc.wait()


def test_a_worker_is_recorded_while_it_runs(cache: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with leftovers.recorded_worker(proc.pid):
            (record,) = (cache / leftovers.WORKERS).iterdir()
            assert processes.marked_by(record.name) == Holder.of(proc.pid)
            assert processes.marked_by(record.read_text()) == Holder.of(os.getpid())
        assert list((cache / leftovers.WORKERS).iterdir()) == []
    finally:
        proc.kill()
        proc.wait()
