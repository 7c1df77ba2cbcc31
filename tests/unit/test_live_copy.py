"""Live copies against a real process standing in for QEMU: a child that maps a
"RAM" file privately and writes, zeroes and drops pages on command. The snapshot
written around a pause (SIGSTOP) must equal the child's memory at the pause, byte
for byte, whatever the child did between the precopy and the pause; remote system
calls leave the process running as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.vmm.snapshot import memory, remote_syscall, write_tracking
from forkd.vmm.snapshot.live_copy import LiveCopy

PAGE = memory.PAGE
NPAGES = 256

pytestmark = pytest.mark.skipif(
    write_tracking.problem() is not None,
    reason=f"this host cannot track writes: {write_tracking.problem()}",
)

CHILD = textwrap.dedent(
    """
    import mmap, os, sys, threading, time
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    fd = os.open(sys.argv[1], os.O_RDONLY)
    ram = mmap.mmap(
        fd, int(sys.argv[2]), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    print(os.getpid(), flush=True)
    for line in sys.stdin:
        op, page, byte = line.split()
        at, page = int(page) * mmap.PAGESIZE, int(page)
        if op == "w":
            ram[at:at + mmap.PAGESIZE] = bytes([int(byte)]) * mmap.PAGESIZE
        elif op == "drop":
            ram.madvise(mmap.MADV_DONTNEED, at, mmap.PAGESIZE)
        print("ok", flush=True)
    """
)


class Child:
    def __init__(self, ram_file: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ram_file), str(NPAGES * PAGE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.pid = int(self.proc.stdout.readline())

    def do(self, op: str, page: int, byte: int = 0) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{op} {page} {byte}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def memory(self, region: memory.RamRegion) -> bytes:
        with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
            return os.pread(mem.fileno(), region.size, region.start)


@pytest.fixture(params=["data base", "empty base"])
def child(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Child, Path]]:
    ram = tmp_path / "ram.bin"
    with ram.open("wb") as f:
        f.truncate(NPAGES * PAGE)
        if request.param == "data base":
            f.write(os.urandom(NPAGES * PAGE // 2))  # the second half stays a hole
    proc = Child(ram)
    try:
        yield proc, ram
    finally:
        proc.proc.kill()
        proc.proc.wait()


def _snapshot_around(
    child: Child, ram: Path, out: Path, between: list[tuple[str, int, int]]
) -> None:
    region = memory.find_ram_region(child.pid, ram, NPAGES * PAGE)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    tracker = write_tracking.WriteTracker.attach(child.pid, region.start, region.end)
    try:
        stats = memory.clone_base(region, fd)
        copy = LiveCopy(
            tracker, region, fd, base_is_empty=stats.base_bytes_cloned == 0, stats=stats
        )
        copy.precopy()
        assert copy.precopy_pages == 3
        for op in between:
            child.do(*op)
        os.kill(child.pid, signal.SIGSTOP)  # the pause
        try:
            deferred = memory.DeferredWrites(limit=1 << 30)
            copy.capture(deferred)
            expected = child.memory(region)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.do("w", 0, 99)  # runs on, and is written after the pause: not in the snapshot
        deferred.flush(fd, base_is_empty=False, stats=stats)
        copy.finish()
    finally:
        tracker.close()
        os.close(fd)
    assert out.read_bytes() == expected


def test_live_copy_equals_memory_at_the_pause(child: tuple[Child, Path], tmp_path: Path) -> None:
    proc, ram = child
    for page, byte in ((1, 7), (2, 8), (200, 9)):  # copied by the precopy
        proc.do("w", page, byte)
    _snapshot_around(
        proc,
        ram,
        tmp_path / "memory.bin",
        [
            ("w", 1, 70),  # rewritten after its copy
            ("w", 2, 0),  # zeroed after its copy: must not stay 8
            ("drop", 200, 0),  # dropped by the process: reads as the base again
            ("w", 3, 5),  # new since the precopy
            ("w", 210, 6),  # new, in the base's hole
        ],
    )


def test_tracking_reports_each_write_once(child: tuple[Child, Path]) -> None:
    proc, ram = child
    region = memory.find_ram_region(proc.pid, ram, NPAGES * PAGE)
    tracker = write_tracking.WriteTracker.attach(proc.pid, region.start, region.end)
    try:
        tracker.written_since_last()  # arms everything
        proc.do("w", 5, 1)
        proc.do("w", 6, 1)
        proc.do("w", 40, 1)
        assert tracker.written_since_last() == [(5 * PAGE, 7 * PAGE), (40 * PAGE, 41 * PAGE)]
        assert tracker.written_since_last() == []
        # The markers the kernel leaves on untouched pages are not "written" pages.
        written = memory.runs_of(memory.written_marks(region), NPAGES)
        assert written == [(5, 7), (40, 41)] or os.geteuid() != 0  # markers: root sees types
        with pytest.raises(OSError):  # one tracker per region at a time
            write_tracking.WriteTracker.attach(proc.pid, region.start, region.end)
    finally:
        tracker.close()


def test_a_remote_call_leaves_the_process_running(child: tuple[Child, Path]) -> None:
    proc, _ = child
    assert remote_syscall.call(proc.pid, 39) == proc.pid  # getpid, made inside the child
    assert remote_syscall.call(proc.pid, remote_syscall.SYS_CLOSE, 987) == -9  # -EBADF
    proc.do("w", 0, 1)  # its main thread was blocked reading stdin: it still is, and answers
    assert proc.proc.poll() is None


def test_the_syscall_instruction_comes_from_the_vdso(child: tuple[Child, Path]) -> None:
    proc, _ = child
    maps = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
    (vdso,) = [line.split()[0] for line in maps if line.endswith("[vdso]")]
    lo, hi = (int(x, 16) for x in vdso.split("-"))
    assert lo <= remote_syscall._syscall_address(proc.pid) < hi  # never a mapping it named


def test_unprivileged_daemons_do_not_track(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_tracking, "_problem", False)
    monkeypatch.setattr("forkd.vmm.snapshot.write_tracking.os.geteuid", lambda: 1000)
    assert "root" in str(write_tracking.problem())  # markers would read as written pages
