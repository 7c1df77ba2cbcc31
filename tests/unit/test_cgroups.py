"""A cgroup per VM, both backends, over a fake cgroup filesystem (tests/unit/fakes.py).

The fake plays the kernel's part: a new group comes with the files the kernel
would make, and a group with a live process in it cannot be removed. What
forkd writes is read back as the kernel would take it. The QEMU hardening
beside it (``-sandbox`` and its fallback) is at the end.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from forkd.errors import Invalid, VMError
from forkd.vmm import runtime_meta
from forkd.vmm.jail import cgroups
from forkd.vmm.qemu import launch
from forkd.vmm.qemu.argv import SANDBOX, MachineConfig, RuntimePaths, build_argv
from tests.unit.fake_cgroups import FakeCgroupFS

MIB = 1 << 20


@pytest.fixture
def v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCgroupFS:
    return FakeCgroupFS(tmp_path / "cg", v2=False).install(monkeypatch)


@pytest.fixture
def v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCgroupFS:
    return FakeCgroupFS(tmp_path / "cg", v2=True).install(monkeypatch)


def read(path: Path) -> str:
    return path.read_text().strip()


def run_in(group: cgroups.Group) -> subprocess.Popen[bytes]:
    """A process moved into ``group`` as QEMU is (right after it started)."""
    proc = subprocess.Popen(["sleep", "30"])
    cgroups.move(group, proc.pid)
    return proc


# ------------------------------------------------------------------ limits


def test_default_memory_cap_is_guest_ram_plus_qemu_overhead() -> None:
    caps = cgroups.limits_for(256, 2, "tcg")
    assert caps.memory_bytes == (256 + cgroups.OVERHEAD_MIB["tcg"]) * MIB
    assert (caps.cpu_quota_us, caps.cpu_period_us) == (200_000, 100_000)  # two vCPUs
    assert caps.pids_max == cgroups.PIDS_BASE + 2
    assert cgroups.limits_for(256, 1, "kvm").memory_mib == 256 + cgroups.OVERHEAD_MIB["kvm"]


def test_an_asked_memory_limit_is_the_cap_even_below_guest_ram() -> None:
    assert cgroups.limits_for(1024, 1, "tcg", memory_limit_mib=300).memory_mib == 300


def test_a_memory_limit_below_qemus_own_needs_is_refused() -> None:
    least = cgroups.min_memory_limit_mib("tcg")
    with pytest.raises(Invalid, match=f"below what this sandbox needs.*least is {least}"):
        cgroups.limits_for(256, 1, "tcg", memory_limit_mib=least - 1)


@pytest.mark.parametrize("parent", ["../etc", "/abs", "a/../../b", "a b", "", "a//b"])
def test_parent_names_cannot_leave_the_hierarchy(parent: str) -> None:
    with pytest.raises(Invalid, match="cgroup parent"):
        cgroups.detect(Path("/nonexistent"), parent)


# ------------------------------------------------------------------ v1


def test_v1_group_in_each_controller_with_the_limits(v1: FakeCgroupFS) -> None:
    h = cgroups.detect(v1.root, "forkd")
    assert (h.version, h.controllers) == ("v1", ("memory", "cpu", "pids"))
    group = h.create("sb-1", cgroups.limits_for(256, 2, "tcg"))
    assert group is not None
    mem, cpu, pids = (v1.root / c / "forkd" / "sb-1" for c in ("memory", "cpu", "pids"))
    assert group.dirs == (mem, cpu, pids)
    limit = str((256 + cgroups.OVERHEAD_MIB["tcg"]) * MIB)
    assert read(mem / "memory.limit_in_bytes") == limit
    assert read(mem / "memory.memsw.limit_in_bytes") == limit  # RAM + swap = RAM: no swap
    assert read(cpu / "cpu.cfs_period_us") == "100000"
    assert read(cpu / "cpu.cfs_quota_us") == "200000"
    assert read(pids / "pids.max") == str(cgroups.PIDS_BASE + 2)


def test_v1_without_swap_accounting_sets_the_memory_cap_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FakeCgroupFS(tmp_path / "cg", v2=False, swap=False).install(monkeypatch)
    group = cgroups.detect(fs.root, "forkd").create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert group is not None
    mem = group.dirs[0]
    assert read(mem / "memory.limit_in_bytes") == str(384 * MIB)
    assert not (mem / "memory.memsw.limit_in_bytes").exists()


def test_v1_uses_the_controllers_the_host_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FakeCgroupFS(tmp_path / "cg", v2=False, controllers=("memory", "pids")).install(
        monkeypatch
    )
    h = cgroups.detect(fs.root, "forkd")
    assert h.controllers == ("memory", "pids")
    group = h.create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert group is not None and [d.parent.parent.name for d in group.dirs] == ["memory", "pids"]


def test_the_process_joins_every_hierarchy_before_exec_and_the_group_goes_after_it(
    v1: FakeCgroupFS,
) -> None:
    group = cgroups.detect(v1.root, "forkd").create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert group is not None
    proc = run_in(group)
    try:
        for d in group.dirs:
            assert read(d / "cgroup.procs") == str(proc.pid)
        # The kernel refuses while the process is in the group.
        assert cgroups.remove(group, wait=0.1) is False
        assert all(d.is_dir() for d in group.dirs)
    finally:
        proc.kill()
        proc.wait()
    assert cgroups.remove(group) is True
    assert v1.groups() == []


def test_a_group_is_removed_once_its_process_exits_within_the_wait(v1: FakeCgroupFS) -> None:
    group = cgroups.detect(v1.root, "forkd").create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert group is not None
    proc = subprocess.Popen(["sleep", "0.3"])
    cgroups.move(group, proc.pid)
    try:
        assert cgroups.remove(group, wait=5.0) is True  # retried while it exits
    finally:
        proc.wait()
    assert v1.groups() == []


def test_a_limit_the_kernel_refuses_leaves_no_group(
    v1: FakeCgroupFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = cgroups._write

    def refuse_pids(path: Path, value: str) -> None:
        if path.name == "pids.max":
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write(path, value)

    monkeypatch.setattr(cgroups, "_write", refuse_pids)
    h = cgroups.detect(v1.root, "forkd")
    with pytest.raises(VMError, match="pids"):
        h.create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert v1.groups() == []


def test_an_empty_leftover_group_of_the_same_name_is_replaced(v1: FakeCgroupFS) -> None:
    h = cgroups.detect(v1.root, "forkd")
    caps = cgroups.limits_for(256, 1, "tcg")
    h.create("sb-1", caps)  # a daemon died before removing it
    group = h.create("sb-1", cgroups.limits_for(512, 1, "tcg"))
    assert group is not None
    assert read(group.dirs[0] / "memory.limit_in_bytes") == str((512 + 128) * MIB)


def test_a_group_in_use_is_never_taken_over(v1: FakeCgroupFS) -> None:
    h = cgroups.detect(v1.root, "forkd")
    group = h.create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    assert group is not None
    proc = run_in(group)
    try:
        with pytest.raises(VMError, match="in use"):
            h.create("sb-1", cgroups.limits_for(256, 1, "tcg"))
        assert read(group.dirs[0] / "cgroup.procs") == str(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("v2", [False, True])
def test_a_starting_daemon_removes_only_its_own_groups_that_nothing_runs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v2: bool
) -> None:
    fs = FakeCgroupFS(tmp_path / "cg", v2=v2).install(monkeypatch)
    h = cgroups.detect(fs.root, "forkd")
    caps = cgroups.limits_for(256, 1, "tcg")
    dead, live, theirs = (h.create(n, caps) for n in ("sb-abc-0001", "sb-abc-0002", "sb-xyz-0001"))
    assert dead and live and theirs
    proc = run_in(live)
    try:
        assert h.remove_unused(("sb-abc-", "tpl-abc-")) == ["sb-abc-0001"]
        assert not any(d.exists() for d in dead.dirs)
        assert all(d.is_dir() for d in (*live.dirs, *theirs.dirs))  # running; another daemon's
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------ v2


def test_v2_hands_the_controllers_down_and_sets_the_limits(v2: FakeCgroupFS) -> None:
    h = cgroups.detect(v2.root, "forkd/vms")
    assert (h.version, h.controllers) == ("v2", ("memory", "cpu", "pids"))
    # Each level above the VM groups enables the controllers for the next.
    for level in (v2.root, v2.root / "forkd", v2.root / "forkd" / "vms"):
        enabled = {e.lstrip("+") for e in read(level / "cgroup.subtree_control").split()}
        assert {"memory", "cpu", "pids"} <= enabled, level
    group = h.create("sb-1", cgroups.limits_for(256, 2, "tcg", memory_limit_mib=300))
    assert group is not None and group.dirs == (v2.root / "forkd" / "vms" / "sb-1",)
    d = group.dirs[0]
    assert read(d / "memory.max") == str(300 * MIB)
    assert read(d / "memory.swap.max") == "0"
    assert read(d / "cpu.max") == "200000 100000"
    assert read(d / "pids.max") == str(cgroups.PIDS_BASE + 2)
    proc = run_in(group)
    try:
        assert read(d / "cgroup.procs") == str(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert cgroups.remove(group) and not d.exists()


def test_v2_without_the_memory_controller_means_no_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FakeCgroupFS(tmp_path / "cg", v2=True, controllers=("cpu", "pids")).install(monkeypatch)
    h = cgroups.detect(fs.root, "forkd")
    assert isinstance(h, cgroups.NoCgroups) and "memory controller" in h.describe()


# ------------------------------------------------------------------ fallback


def test_no_cgroup_filesystem_means_no_caps_and_says_why(tmp_path: Path) -> None:
    h = cgroups.detect(tmp_path / "nothing", "forkd")
    assert isinstance(h, cgroups.NoCgroups) and not h.limits_memory
    assert h.create("sb-1", cgroups.limits_for(256, 1, "tcg")) is None
    assert "no cgroup filesystem" in h.describe()


def test_a_cgroup_fs_forkd_may_not_write_means_no_caps(
    v1: FakeCgroupFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(path: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(cgroups, "make_dir", denied)  # what a non-root daemon meets
    h = cgroups.detect(v1.root, "forkd")
    assert isinstance(h, cgroups.NoCgroups)
    assert "Permission denied" in h.describe() and "without" in h.describe()


# ------------------------------------------------------------------ vm.json


def test_the_group_is_recorded_in_vm_json_for_a_daemon_that_adopts_the_vm(
    v1: FakeCgroupFS, tmp_path: Path
) -> None:
    group = cgroups.detect(v1.root, "forkd").create("sb-1", cgroups.limits_for(256, 1, "tcg"))
    rt = RuntimePaths(tmp_path / "run" / "sb-1")
    rt.dir.mkdir(parents=True)
    machine = MachineConfig(256, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
    record = runtime_meta.VMRecord(
        id="sb-1",
        pid=1,
        qmp=rt.qmp,
        agent=rt.agent,
        ram_file=rt.ram,
        origin_snapshot=None,
        machine=machine,
        image=None,
        started_at_unix=0.0,
        cgroup=group,
    )
    runtime_meta.write(rt, record)
    assert runtime_meta.read(rt).cgroup == group


# ------------------------------------------------------------------ -sandbox


def test_qemu_runs_under_the_seccomp_sandbox() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    cfg = MachineConfig(256, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
    argv = build_argv(cfg, rt, ram_file=rt.ram, incoming=True)
    assert argv[argv.index("-sandbox") + 1] == SANDBOX
    assert {"obsolete=deny", "elevateprivileges=deny", "spawn=deny", "resourcecontrol=deny"} <= set(
        SANDBOX.split(",")
    )
    assert "-sandbox" not in build_argv(cfg, rt, ram_file=rt.ram, incoming=True, sandbox=False)


def test_a_qemu_without_seccomp_is_found_out_and_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = tmp_path / "bin" / "qemu-system-x86_64"
    fake.parent.mkdir()
    # What a QEMU built without seccomp answers to -sandbox.
    fake.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "sys.stderr.write('qemu-system-x86_64: -sandbox on: There is no option group "
        "\\'sandbox\\'\\n')\nsys.exit(1)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    launch.seccomp_problem.cache_clear()
    try:
        problem = launch.seccomp_problem()
    finally:
        launch.seccomp_problem.cache_clear()
    assert problem is not None and "no option group 'sandbox'" in problem
    assert "without -sandbox" in caplog.text


@pytest.mark.parametrize(
    ("version", "name", "text", "killed"),
    [
        (
            "v2",
            "memory.events",
            "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n",
            True,
        ),
        ("v2", "memory.events", "low 0\nhigh 0\nmax 3\noom 0\noom_kill 0\n", False),
        ("v1", "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n", True),
        ("v1", "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n", False),  # before 4.13
    ],
)
def test_a_group_tells_whether_the_oom_killer_struck_in_it(
    tmp_path: Path, version: str, name: str, text: str, killed: bool
) -> None:
    (tmp_path / name).write_text(text)
    assert cgroups.oom_killed(cgroups.Group(version, (tmp_path,))) is killed


def test_a_group_that_is_gone_or_none_tells_no_oom(tmp_path: Path) -> None:
    assert not cgroups.oom_killed(None)
    assert not cgroups.oom_killed(cgroups.Group("v2", (tmp_path / "gone",)))
