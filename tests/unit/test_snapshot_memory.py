"""The memory strategies of a snapshot against a real process standing in for QEMU
(:class:`tests.unit.test_live_copy.Child`): whichever way the pages are copied, the
memory file equals the child's memory at the pause (SIGSTOP), byte for byte; a live
snapshot the host cannot track writes for is taken the pause-copy way, saying why."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from forkd.vmm.snapshot import live_copy, memory, write_tracking
from forkd.vmm.snapshot.files import BaseRef
from forkd.vmm.snapshot.memory_strategy import (
    DiffMemory,
    MemoryRecord,
    MemoryStrategy,
    PauseCopyMemory,
    PrecopyMemory,
    for_snapshot,
)
from forkd.vmm.snapshot.write_tracking import WriteTracker
from tests.unit.test_live_copy import NPAGES, PAGE, Child

T = TypeVar("T")
WRITER_LOG = "forkd.vmm.snapshot.writer"  # the strategies log as the writer did


async def _thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


@dataclass
class Source:
    """The VM as the strategies see it
    (:class:`forkd.vmm.snapshot.memory_strategy.MemorySource`)."""

    pid: int
    id: str = "vm-t"
    origin: Path | None = None
    origin_id: str | None = None
    write_tracker: WriteTracker | None = None


@pytest.fixture(params=["data base", "empty base"])
def child(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Child, Path]]:
    ram = tmp_path / "ram.bin"
    with ram.open("wb") as f:
        f.truncate(NPAGES * PAGE)
        if request.param == "data base":
            f.write(os.urandom(NPAGES * PAGE // 2))  # the second half stays a hole
    proc = Child(ram)
    for page, byte in ((1, 7), (2, 8), (200, 9)):  # before the snapshot starts
        proc.do("w", page, byte)
    try:
        yield proc, ram
    finally:
        proc.proc.kill()
        proc.proc.wait()


def _snapshot(strategy: MemoryStrategy, child: Child, ram: Path, out: Path) -> MemoryRecord:
    """prepare (running), the child writes on, capture (stopped), finish (running again):
    the file must hold the child's memory at the stop."""
    region = memory.find_ram_region(child.pid, ram, NPAGES * PAGE)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        asyncio.run(strategy.prepare(region, fd))
        for op in (("w", 3, 5), ("w", 1, 0), ("drop", 2, 0)):  # after the prepare
            child.do(*op)
        os.kill(child.pid, signal.SIGSTOP)  # the pause
        try:
            asyncio.run(strategy.capture(region, fd))
            expected = child.memory(region)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.do("w", 0, 99)  # after the pause: not in the snapshot
        asyncio.run(strategy.finish(fd, out.parent))
    finally:
        strategy.close()
        os.close(fd)
    assert out.read_bytes() == expected
    return strategy.record()


def test_a_base_makes_a_diff_live_a_precopy_and_else_a_pause_copy() -> None:
    vm, base = Source(pid=1), BaseRef("base", "/snaps/base", "id-1")
    assert isinstance(for_snapshot(vm, base, live=True, thread=_thread), DiffMemory)
    assert isinstance(for_snapshot(vm, None, live=True, thread=_thread), PrecopyMemory)
    pause_copy = for_snapshot(vm, None, live=False, thread=_thread)
    assert type(pause_copy) is PauseCopyMemory
    assert pause_copy.file_name == "memory.bin"
    assert for_snapshot(vm, base, live=False, thread=_thread).file_name == "memory.diff"


def test_a_pause_copy_holds_the_memory_at_the_pause(
    child: tuple[Child, Path], tmp_path: Path
) -> None:
    record = _snapshot(PauseCopyMemory(_thread), *child, tmp_path / "memory.bin")
    assert (record.mode, record.precopied_pages, record.base, record.chain) == ("full", 0, None, ())
    assert record.pages_written > 0


@pytest.mark.skipif(
    write_tracking.problem() is not None,
    reason=f"this host cannot track writes: {write_tracking.problem()}",
)
def test_a_precopy_holds_the_memory_at_the_pause(child: tuple[Child, Path], tmp_path: Path) -> None:
    vm = Source(pid=child[0].pid)
    try:
        record = _snapshot(PrecopyMemory(vm, _thread), *child, tmp_path / "memory.bin")
    finally:
        if vm.write_tracker is not None:
            vm.write_tracker.close()
    assert (record.mode, record.precopied_pages) == ("full", 3)  # the pages written before


def test_a_precopy_without_write_tracking_is_a_pause_copy_saying_why(
    child: tuple[Child, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(write_tracking, "problem", lambda: "no tracking on this host")
    vm = Source(pid=child[0].pid)
    with caplog.at_level(logging.DEBUG, logger=WRITER_LOG):
        record = _snapshot(PrecopyMemory(vm, _thread), *child, tmp_path / "memory.bin")
    assert record.precopied_pages == 0 and vm.write_tracker is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == WRITER_LOG] == [
        (logging.DEBUG, "live snapshot of vm-t taken with a pause-copy: no tracking on this host")
    ]


def test_a_precopy_whose_tracker_fails_is_a_pause_copy_with_a_warning(
    child: tuple[Child, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(*_: object) -> WriteTracker:
        raise OSError(errno.EPERM, "not here")

    monkeypatch.setattr(write_tracking, "problem", lambda: None)
    monkeypatch.setattr(live_copy, "tracker_for", refuse)
    vm = Source(pid=child[0].pid)
    with caplog.at_level(logging.DEBUG, logger=WRITER_LOG):
        record = _snapshot(PrecopyMemory(vm, _thread), *child, tmp_path / "memory.bin")
    assert record.precopied_pages == 0 and vm.write_tracker is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == WRITER_LOG] == [
        (
            logging.WARNING,
            "cannot track the writes of vm-t ([Errno 1] not here): pause-copy instead",
        )
    ]
