"""The uid each QEMU drops to: one per running VM, from the host-wide registry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd import doctor
from forkd.errors import ForkdError, Invalid, OverCapacity
from forkd.processes import Holder
from forkd.vmm.jail import qemu_user
from forkd.vmm.jail.qemu_user import Registry, UidRange
from forkd.vmm.qemu import host_processes
from forkd.vmm.qemu.argv import SANDBOX, SANDBOX_RUNAS, MachineConfig, RuntimePaths, build_argv
from forkd.vmm.volumes.disks import Attachment

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other uids")


@pytest.fixture(autouse=True)
def restore_choice() -> Iterator[None]:
    yield
    qemu_user.configure(qemu_user.DEFAULT_RANGE)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts to hold uids, killed after it."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]], uid: int | None = None) -> int:
    """A process that runs until the test ends (as ``uid`` when given): a stand-in QEMU."""
    ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    proc = subprocess.Popen(["sleep", "60"], cwd="/", **ids)  # type: ignore[call-overload]
    procs.append(proc)
    return proc.pid


def test_a_range_is_start_dash_end_of_real_ids() -> None:
    assert UidRange.parse("65536-99999") == UidRange(65536, 99999)
    assert len(UidRange.parse(" 7-7 ")) == 1
    for bad in ("", "70000", "70000-", "a-b", "0-10", "20-10", "1-4294967295", "-5-10"):
        with pytest.raises(Invalid, match="vm-uid-range"):
            UidRange.parse(bad)


def test_the_default_range_avoids_subordinate_ids_and_systems_users() -> None:
    first, last = qemu_user.DEFAULT_RANGE.first, qemu_user.DEFAULT_RANGE.last
    assert first > 65535  # 16-bit ids, nobody (65534), systemd's dynamic users (61184-65519)
    assert last < 100000  # /etc/subuid's SUB_UID_MIN


def test_no_two_held_uids_are_the_same_and_a_full_range_is_refused_clearly(
    tmp_path: Path,
) -> None:
    reg = Registry(UidRange(70000, 70009), tmp_path / "uids")
    leases = [reg.reserve() for _ in range(10)]
    assert sorted(lease.uid for lease in leases) == list(range(70000, 70010))
    with pytest.raises(OverCapacity, match="70000-70009") as exc:
        reg.reserve()
    assert "widen the range" in str(exc.value)
    leases[3].release()  # a start that failed before QEMU ran
    assert reg.reserve().uid == 70003


def test_a_uid_is_held_while_its_qemu_runs_and_free_once_it_exits(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    reg = Registry(UidRange(70000, 70000), tmp_path / "uids")
    lease = reg.reserve()
    qemu = _sleeper(children)
    lease.bind(qemu)
    assert reg.holder(70000) == Holder.of(qemu)
    lease.release()  # the VM was killed but its QEMU outlived SIGKILL: still held
    with pytest.raises(OverCapacity):
        reg.reserve()
    children[0].kill()
    children[0].wait()
    assert reg.holder(70000) is None  # freed by its exit, before anyone released it
    assert reg.reserve().uid == 70000
    lease.release()  # late: the uid is another's by now, and stays so
    assert reg.holder(70000) == Holder.of(os.getpid())


def test_a_zombie_or_a_reused_pid_holds_no_uid(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    reg = Registry(UidRange(70000, 70001), tmp_path / "uids")
    qemu = _sleeper(children)
    reg.reserve().bind(qemu)
    os.kill(qemu, signal.SIGKILL)  # exited, not yet reaped by its parent
    deadline = time.monotonic() + 5
    while Path(f"/proc/{qemu}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.001)
    me = Holder.of(os.getpid())
    assert me is not None
    reg.hand_over(70001, Holder(me.pid, me.start_ticks + 1))  # this pid, another process
    assert reg.holder(70000) is None and reg.holder(70001) is None


def test_uids_are_handed_out_in_turn_so_a_freed_one_is_reused_last(tmp_path: Path) -> None:
    reg = Registry(UidRange(70000, 70002), tmp_path / "uids")
    first = reg.reserve()
    first.release()
    assert [reg.reserve().uid for _ in range(3)] == [70001, 70002, 70000]


def test_another_process_sees_the_uids_held_here(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    """A second daemon, a template build, or this daemon restarted: the registry is on disk."""
    directory = tmp_path / "uids"
    held = Registry(UidRange(70000, 70001), directory).reserve()
    held.bind(_sleeper(children))
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "from pathlib import Path\n"
                "from forkd.vmm.jail.qemu_user import Registry, UidRange\n"
                f"print(Registry(UidRange(70000, 70001), Path({str(directory)!r})).reserve().uid)"
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(other.stdout) == 70001  # the other one; 70000's QEMU still runs
    # That process has exited: what it reserved and never handed to a QEMU is free.
    assert Registry(UidRange(70000, 70001), directory).reserve().uid == 70001


def test_the_registry_must_be_writable_by_its_owner_alone(tmp_path: Path) -> None:
    directory = tmp_path / "uids"
    directory.mkdir(mode=0o700)
    directory.chmod(0o777)
    with pytest.raises(ForkdError, match="no one else may write"):
        Registry(UidRange(70000, 70001), directory).reserve()


@needs_root
def test_a_restarted_daemon_takes_back_the_uid_of_each_qemu_it_adopts(
    tmp_path: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    """Read from the live process, even when the registry lost its entry."""
    qemu_user.configure(UidRange(70000, 70001), tmp_path / "uids")
    adopted = _sleeper(children, uid=70001)
    lease = qemu_user.adopt(adopted, host_processes.owner_uid(adopted))
    assert lease is not None and lease.uid == 70001
    assert qemu_user.reserve() is not None  # 70000
    with pytest.raises(OverCapacity):
        qemu_user.reserve()
    outside = _sleeper(children, uid=71000)
    assert qemu_user.adopt(outside, host_processes.owner_uid(outside)) is None


def test_every_uid_of_the_range_counts_as_a_qemu_of_ours() -> None:
    qemu_user.configure(UidRange(70000, 70009))
    ours = qemu_user.qemu_uids()
    assert os.geteuid() in ours and 70000 in ours and 70009 in ours
    assert 69999 not in ours and 70010 not in ours and None not in ours


def test_none_keeps_the_daemons_user() -> None:
    qemu_user.configure(None)
    uids, why = qemu_user.current()
    assert uids is None and "--qemu-user none" in why
    assert qemu_user.reserve() is None
    assert 70000 not in qemu_user.qemu_uids() and os.geteuid() in qemu_user.qemu_uids()


@needs_root
def test_doctor_warns_of_a_user_inside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_VM_UID_RANGE", "65530-65540")  # nobody is 65534 on Debian
    check = doctor._qemu_user()
    assert not check.ok and "nobody" in check.detail
    monkeypatch.setenv("FORKD_VM_UID_RANGE", str(qemu_user.DEFAULT_RANGE))
    assert doctor._qemu_user().ok


def test_runas_is_numeric_and_keeps_the_filter_without_the_setuid_ban() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    cfg = MachineConfig(256, 1, "tcg", Path("/k"), Path("/i"), Path("/r"))
    vols = [
        Attachment("ro", "/ro", True, ("/v/ro/base.img",)),
        Attachment("rw", "/rw", False, ("/v/rw/layers/a.qcow2", "/v/rw/base.img")),
    ]
    argv = build_argv(
        cfg,
        rt,
        ram_file=rt.ram,
        incoming=True,
        volumes=vols,
        runas="70000:70000",
        layer_fds={1: (7, 8)},
    )
    assert argv[argv.index("-runas") + 1] == "70000:70000"
    assert argv[argv.index("-sandbox") + 1] == SANDBOX_RUNAS
    assert "elevateprivileges" not in SANDBOX_RUNAS and "spawn=deny" in SANDBOX_RUNAS
    joined = " ".join(argv)
    assert "file=/v/ro/base.img," in joined  # read-only: opened once, by name, before the drop
    assert "-add-fd fd=7,set=2,opaque=ro -add-fd fd=8,set=2,opaque=rw" in joined
    assert "file=/dev/fdset/2,format=qcow2" in joined and "a.qcow2" not in joined
    plain = build_argv(cfg, rt, ram_file=rt.ram, incoming=True)
    assert "-runas" not in plain and plain[plain.index("-sandbox") + 1] == SANDBOX


def test_a_process_owner_is_its_real_uid_not_the_owner_of_its_proc_directory() -> None:
    assert host_processes.owner_uid(os.getpid()) == os.getuid()
    assert host_processes.owner_uid(2**22 + 12345) is None  # no such process
