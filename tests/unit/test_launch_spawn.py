"""How QEMU is started (:func:`forkd.vmm.qemu.launch.spawn`), with a stand-in command.

No Python runs between fork and exec: the cgroup is joined at a gate before
the command runs, the namespace is entered by ``nsenter`` and the parent-death
signal and the capabilities set by ``setpriv``. Each is checked from the
command's own point of view: it must already be in its group, in its
namespace, hold only what it needs, and die with its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from forkd import hosttools
from forkd.errors import HostToolMissing
from forkd.processes import Holder
from forkd.vmm.jail import cgroups, netns_ops, network, qemu_user
from forkd.vmm.qemu import launch
from forkd.vmm.qemu.argv import RuntimePaths
from tests.unit.fake_cgroups import FakeCgroupFS


def _rt(tmp_path: Path) -> RuntimePaths:
    return launch.prepare_runtime(tmp_path / "run", f"vm-{uuid.uuid4().hex[:6]}")


def _wait_for(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return path.read_text().strip()


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> cgroups.Group:
    """A VM's group on a fake cgroup v2 filesystem (tests/unit/fake_cgroups.py)."""
    fake = FakeCgroupFS(tmp_path / "cg", v2=True).install(monkeypatch)
    made = cgroups.detect(fake.root, "forkd").create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert made is not None
    return made


def test_the_command_runs_only_once_it_is_in_its_group(
    tmp_path: Path, group: cgroups.Group
) -> None:
    procs = group.dirs[0] / "cgroup.procs"
    out = tmp_path / "seen"
    # The command looks itself up in the group's (fake) cgroup.procs as it starts.
    check = f'grep -qx "$$" {procs} && echo in-group > {out} || echo outside > {out}'
    proc = launch.spawn(["sh", "-c", check], _rt(tmp_path), detach=True, cgroup=group)
    assert _wait_for(out) == "in-group"
    assert proc.wait(10) == 0


def test_a_command_whose_group_cannot_be_joined_never_runs(
    tmp_path: Path, group: cgroups.Group
) -> None:
    (group.dirs[0] / "cgroup.procs").unlink()  # the kernel refuses the move
    out = tmp_path / "ran"
    rt = _rt(tmp_path)
    with pytest.raises(OSError):
        launch.spawn(["sh", "-c", f"echo ran > {out}"], rt, detach=True, cgroup=group)
    time.sleep(0.3)
    assert not out.exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or network.netns_problems() != [],
    reason=f"needs root and network namespaces: {network.netns_problems()}",
)
def test_the_command_starts_inside_its_namespace(tmp_path: Path) -> None:
    name = f"forkd-test-{uuid.uuid4().hex[:8]}"
    netns_ops.create(name)
    try:
        out = tmp_path / "ns"
        cmd = ["sh", "-c", f"readlink /proc/self/ns/net > {out}"]
        proc = launch.spawn(cmd, _rt(tmp_path), detach=True, netns=name)
        assert proc.wait(10) == 0
        expected = netns_ops.run_inside(name, lambda: os.readlink("/proc/thread-self/ns/net"))
        assert _wait_for(out) == expected
        assert expected != os.readlink("/proc/self/ns/net")
    finally:
        netns_ops.remove(name)


def test_a_command_not_detached_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A parent that starts one and is then killed with SIGKILL: no cleanup of its
    # own runs, the parent-death signal alone ends the command.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from pathlib import Path\n"
                "from forkd.vmm.qemu import launch\n"
                f"rt = launch.prepare_runtime(Path({str(tmp_path)!r}), 'vm-orphan')\n"
                "p = launch.spawn(['sleep', '60'], rt, detach=False)\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    # setpriv sets the parent-death signal, then execs the command: once the command
    # runs, the signal is armed. (Before that, a parent killed in the window leaves no
    # signal: the daemon's restart reaps such a process; see RUNBOOK.)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.01)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the command outlived the process that started it")


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie has ended (its reaping is init's business,
    and a busy or unusual init may take its time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_a_missing_helper_program_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = hosttools.require

    def without_setpriv(tool: str) -> str:
        if tool == "setpriv":
            raise HostToolMissing(tool, "util-linux")
        return real(tool)

    monkeypatch.setattr(hosttools, "require", without_setpriv)  # as launch calls it
    rt = _rt(tmp_path)
    with pytest.raises(HostToolMissing):
        launch.spawn(["true"], rt, detach=False)
    assert not rt.qemu_log.exists()  # refused before anything started


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has capabilities to drop")
def test_a_command_that_drops_starts_with_only_the_capabilities_of_the_drop(
    tmp_path: Path,
) -> None:
    """CAP_SETUID and CAP_SETGID for -runas, an empty bounding set, no new privileges;
    and the uid is handed to the process as soon as it exists."""
    registry = qemu_user.Registry(qemu_user.UidRange(70000, 70000), tmp_path / "uids")
    lease = registry.reserve()
    out = tmp_path / "status"
    cmd = [
        "sh",
        "-c",
        f"grep -E '^(Cap|NoNewPrivs)' /proc/self/status > {out}.tmp && "
        f"mv {out}.tmp {out} && sleep 60",
    ]
    proc = launch.spawn(cmd, _rt(tmp_path), detach=True, uid=lease)
    try:
        assert registry.holder(70000) == Holder.of(proc.pid)
        deadline = time.monotonic() + 10
        while not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status = dict(line.split(":\t") for line in out.read_text().splitlines())
        setuid_setgid = (1 << 6) | (1 << 7)
        assert int(status["CapPrm"], 16) == int(status["CapEff"], 16) == setuid_setgid
        assert int(status["CapInh"], 16) == setuid_setgid  # what -runas needs, kept past exec
        assert int(status["CapBnd"], 16) == int(status["CapAmb"], 16) == 0
        assert status["NoNewPrivs"] == "1"
    finally:
        proc.kill()
        proc.wait()
    assert registry.holder(70000) is None
