"""The /proc scans that find forkd's QEMU processes, run against real (harmless) processes.

Each stand-in is a Python interpreter started with ``argv[0]`` set to the
name under test and QEMU's ``-qmp`` option among its arguments, so /proc
shows the command line a QEMU of ours would have.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkd.vmm.qemu.host_processes import qemu_pid_matches, qemu_pids_under, qemu_run_dirs

SLEEP = "import time; time.sleep(60)"
Spawn = Callable[..., int]


def _qmp_arg(run_dir: Path) -> str:
    return f"unix:{run_dir}/qmp.sock,server=on,wait=off"


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv0: str, *args: str) -> int:
        proc = subprocess.Popen([argv0, "-c", SLEEP, *args], executable=sys.executable)
        procs.append(proc)
        # Popen returns while the kernel may still be setting up the new
        # command line (/proc shows it empty for a moment): wait for it.
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 5
        while not cmdline.read_bytes().startswith(argv0.encode()):
            assert time.monotonic() < deadline, "the stand-in never showed its command line"
            time.sleep(0.001)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_finds_qemus_naming_a_path_under_a_root(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    qemu = spawn("/usr/bin/qemu-system-x86_64", "-qmp", _qmp_arg(run / "vm-1"))
    not_qemu = spawn("python3", "-qmp", _qmp_arg(run / "vm-2"))
    elsewhere = spawn("qemu-system-x86_64", "-qmp", _qmp_arg(tmp_path / "other" / "vm-3"))
    found = qemu_pids_under(run)
    assert qemu in found
    assert not_qemu not in found  # argv[0] must be a QEMU
    assert elsewhere not in found
    # A sibling whose name only starts like the root is not under it.
    assert qemu not in qemu_pids_under(tmp_path / "ru")


def test_run_dirs_are_direct_children_of_the_run_root(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    direct = spawn("qemu-system-x86_64", "-name", "forkd-vm-1", "-qmp", _qmp_arg(run / "vm-1"))
    nested = spawn("qemu-system-x86_64", "-qmp", _qmp_arg(run / "a" / "vm-2"))
    other_option = spawn("qemu-system-x86_64", "-drive", f"file={run}/vm-3/qmp.sock")
    dirs = qemu_run_dirs(run)
    assert dirs.get(direct) == run / "vm-1"
    assert nested not in dirs
    assert other_option not in dirs


def test_a_run_dir_that_climbs_out_of_the_root_is_not_ours(tmp_path: Path, spawn: Spawn) -> None:
    # The daemon deletes the run directory of each stray QEMU it finds: a
    # command line naming <run>/../qmp.sock must not make it delete <run>/..
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "outside").mkdir()
    (run / "link").symlink_to(tmp_path / "outside")
    up = spawn("qemu-system-x86_64", "-qmp", f"unix:{run}/../qmp.sock,server=on,wait=off")
    dot = spawn("qemu-system-x86_64", "-qmp", f"unix:{run}/./qmp.sock,server=on,wait=off")
    link = spawn("qemu-system-x86_64", "-qmp", _qmp_arg(run / "link"))
    dirs = qemu_run_dirs(run)
    assert up not in dirs and dot not in dirs and link not in dirs


def test_run_dir_with_a_comma_is_read_back_undoubled(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    pid = spawn("qemu-system-x86_64", "-qmp", f"unix:{run}/vm,,1/qmp.sock,server=on,wait=off")
    assert qemu_run_dirs(run).get(pid) == run / "vm,1"


def test_pid_matches_only_the_qemu_of_that_run_dir(tmp_path: Path, spawn: Spawn) -> None:
    run = tmp_path / "run"
    pid = spawn("qemu-system-x86_64", "-qmp", _qmp_arg(run / "vm-1"))
    assert qemu_pid_matches(pid, run / "vm-1")
    assert not qemu_pid_matches(pid, run / "vm-2")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not qemu_pid_matches(dead.pid, run / "vm-1")
