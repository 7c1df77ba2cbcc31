"""Enforced limits on real VMs: a cgroup per sandbox, QEMU under -sandbox, admission.

Read from the real cgroup filesystem (v2, or v1 per controller) and from
/proc, against a real ``forkd serve`` with its default caps.
"""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.controller.services import host_memory
from forkd.vmm.jail import cgroups, qemu_user
from forkd.vmm.qemu.argv import SANDBOX_RUNAS
from tests.other_uid import SYSTEM_PYTHON

from .conftest import Daemon

ROOT = Path("/sys/fs/cgroup")
MIB = 1 << 20
GUEST_MIB = 256  # api_template's


@pytest.fixture(scope="module")
def c(daemon: Any, api_template: str) -> httpx.Client:
    if not cgroups.probe().limits_memory:
        pytest.skip("no writable cgroup filesystem here (forkd doctor says why)")
    return httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=300
    )


def fork(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 1, **body})
    assert r.status_code == 201, r.text
    return r.json()[0]


def groups_of(pid: int) -> dict[str, Path]:
    """The directory of ``pid``'s group for memory, cpu and pids, from /proc/PID/cgroup."""
    where: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["unified"]:
            where[name] = path.lstrip("/")
    if (ROOT / "cgroup.controllers").is_file():  # v2: one tree
        return {k: ROOT / where["unified"] for k in ("memory", "cpu", "pids")}
    return {k: ROOT / k / where[k] for k in ("memory", "cpu", "pids")}


def read(path: Path) -> str:
    return path.read_text().strip()


def memory_limit(memory_dir: Path) -> int:
    f = memory_dir / "memory.max"
    return int(read(f if f.exists() else memory_dir / "memory.limit_in_bytes"))


def memory_usage(memory_dir: Path) -> int:
    f = memory_dir / "memory.current"
    return int(read(f if f.exists() else memory_dir / "memory.usage_in_bytes"))


def wait_state(c: httpx.Client, sid: str, want: str, secs: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + secs
    while True:
        info = c.get(f"/v1/sandboxes/{sid}").json()
        if info["state"] == want or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def credentials(pid: int) -> tuple[int, int]:
    """The one uid and the one gid process ``pid`` holds: real, effective, saved,
    filesystem and its only supplementary group all the same."""
    status = proc_status(pid)
    (uid,), (gid,) = set(status["Uid"].split()), set(status["Gid"].split())
    assert status["Groups"].split() == [gid]
    return int(uid), int(gid)


# A process as another uid and gid with no other group, sending signal 0 to a pid:
# 0 when it may signal it, else the errno (EPERM: another uid's process).
_SIGNAL_PROBE = (
    "import os, sys\n"
    "try:\n    os.kill(int(sys.argv[1]), 0)\nexcept OSError as e:\n    print(e.errno)\n"
    "else:\n    print(0)\n"
)


def signal_errno(uid: int, gid: int, pid: int) -> int:
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", _SIGNAL_PROBE, str(pid)],
        user=uid,
        group=gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(out.stdout)


def test_each_qemu_runs_as_a_uid_of_its_own_with_no_capability_and_cannot_signal_another(
    c: httpx.Client,
) -> None:
    kids = [fork(c), fork(c)]
    try:
        (pid_a, pid_b) = (k["pid"] for k in kids)
        (uid_a, gid_a), (uid_b, gid_b) = credentials(pid_a), credentials(pid_b)
        assert uid_a != uid_b and gid_a != gid_b
        for pid, uid, gid in ((pid_a, uid_a, gid_a), (pid_b, uid_b, gid_b)):
            assert uid in qemu_user.DEFAULT_RANGE and gid == uid
            status = proc_status(pid)
            for caps in ("CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[caps], 16) == 0, (caps, status[caps])
            # What -runas spent on the drop stays inheritable only: with no permitted
            # capability, no bounding set and no_new_privs, nothing can raise it.
            assert int(status["CapInh"], 16) & ~((1 << 6) | (1 << 7)) == 0
            assert status["NoNewPrivs"].strip() == "1"
            holder = qemu_user.Registry(qemu_user.DEFAULT_RANGE).holder(uid)
            assert holder is not None and holder.pid == pid  # the daemon handed it over
        assert signal_errno(uid_a, gid_a, pid_b) == errno.EPERM
        assert signal_errno(uid_a, gid_a, pid_a) == 0  # the probe itself can signal
    finally:
        for k in kids:
            assert c.delete(f"/v1/sandboxes/{k['id']}").status_code == 204
    # Each uid is free again once its QEMU is gone.
    assert qemu_user.Registry(qemu_user.DEFAULT_RANGE).holder(uid_a) is None


def test_a_sandboxs_qemu_runs_unprivileged_in_its_own_capped_cgroup(c: httpx.Client) -> None:
    kid = fork(c)
    pid = kid["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Seccomp:\t2" in status  # a filter is on
    # The daemon runs as root: QEMU dropped to a uid of its own (see below).
    uid = credentials(pid)[0]
    assert argv[argv.index("-runas") + 1] == f"{uid}:{uid}"
    assert argv[argv.index("-sandbox") + 1] == SANDBOX_RUNAS
    dirs = groups_of(pid)
    assert all(d.name == kid["id"] and d.parent.name == "forkd" for d in dirs.values()), dirs
    assert int(read(dirs["memory"] / "cgroup.procs").split()[0]) == pid
    want = (GUEST_MIB + cgroups.OVERHEAD_MIB["tcg"]) * MIB  # the default: guest RAM + QEMU
    assert memory_limit(dirs["memory"]) == want
    memsw = dirs["memory"] / "memory.memsw.limit_in_bytes"
    swap = dirs["memory"] / "memory.swap.max"
    if memsw.exists():
        assert int(read(memsw)) == want  # no swap on top
    if swap.exists():
        assert read(swap) == "0"
    if (dirs["cpu"] / "cpu.max").exists():
        assert read(dirs["cpu"] / "cpu.max") == "100000 100000"  # one vCPU: one CPU
    else:
        assert read(dirs["cpu"] / "cpu.cfs_quota_us") == "100000"
        assert read(dirs["cpu"] / "cpu.cfs_period_us") == "100000"
    assert read(dirs["pids"] / "pids.max") == str(cgroups.PIDS_BASE + 1)
    # Under the filter and the caps, a snapshot (xen-save-devices-state) and a
    # fork of it (migrate-incoming by fd) still work.
    r = c.post(f"/v1/sandboxes/{kid['id']}/branch", json={})
    assert r.status_code == 201, r.text
    grandchild = fork(c, snapshot_tag=r.json()["tag"])
    assert (
        c.post(f"/v1/sandboxes/{grandchild['id']}/exec", json={"args": ["true"]}).json()[
            "exit_code"
        ]
        == 0
    )
    for sid in (kid["id"], grandchild["id"]):
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert not any(d.exists() for d in dirs.values())  # the group went with the sandbox
    assert c.delete(f"/v1/snapshots/{r.json()['tag']}").status_code == 204


def test_an_asked_memory_limit_is_the_cgroups_cap(c: httpx.Client) -> None:
    kid = fork(c, memory_limit_mib=300)
    try:
        assert memory_limit(groups_of(kid["pid"])["memory"]) == 300 * MIB
        assert kid["memory_limit_mib"] == 300
    finally:
        c.delete(f"/v1/sandboxes/{kid['id']}")


def test_a_guest_over_its_memory_limit_gets_its_qemu_killed_and_marked_dead(
    c: httpx.Client, daemon: Any
) -> None:
    """An explicit limit below guest RAM: the host kernel kills QEMU at the cap.

    (Under the default cap, guest RAM + QEMU's overhead, the guest runs out of
    its own RAM first and its own kernel deals with it; the host cap is never
    reached.) The daemon notices, marks the sandbox dead and removes its group;
    the host and the other sandboxes carry on.
    """
    limit_mib = cgroups.min_memory_limit_mib("tcg") + 32
    bystander = fork(c)
    hog = fork(c, memory_limit_mib=limit_mib)
    memory_dir = groups_of(hog["pid"])["memory"]
    peak = [0]
    sampling = True

    def sample() -> None:  # what the group holds while the guest allocates
        while sampling:
            try:
                peak[0] = max(peak[0], memory_usage(memory_dir))
            except OSError:
                return  # removed
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    # 200 MiB, a MiB at a time (zeroed, so written): within guest RAM, over the cap.
    grab = "s = [bytearray(1 << 20) for _ in range(200)]\nprint('kept')"
    try:
        r = c.post(
            f"/v1/sandboxes/{hog['id']}/exec",
            json={"args": ["python3", "-c", grab], "timeout_secs": 120},
        )
    finally:
        sampling = False
        sampler.join(10)
    assert r.status_code == 409 and "died" in r.json()["error"], r.text
    assert wait_state(c, hog["id"], "dead")["state"] == "dead"
    assert 0 < peak[0] <= limit_mib * MIB  # the host never gave it more than its cap
    assert not memory_dir.exists()  # its group went with its QEMU
    assert httpx.get(f"{daemon.url}/healthz", timeout=5).status_code == 200
    r = c.post(f"/v1/sandboxes/{bystander['id']}/exec", json={"args": ["echo", "fine"]})
    assert r.json()["stdout"] == "fine\n"
    for sid in (hog["id"], bystander["id"]):
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_requests_over_a_cap_or_under_the_least_limit_start_nothing(c: httpx.Client) -> None:
    before = c.get("/v1/sandboxes").json()
    # n up to 1000 is valid (the original's limit); no host this suite runs on holds as
    # many: this daemon's --max-sandboxes, or what the host's memory holds, refuses it.
    r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 1000})
    assert r.status_code == 429, r.text
    assert re.search(r"\((--max-sandboxes|--memory-reserve)\)", r.json()["error"])
    r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 1, "memory_limit_mib": 64})
    assert r.status_code == 400 and "below what this sandbox needs" in r.json()["error"]
    assert c.get("/v1/sandboxes").json() == before


# ------------------------------------------------------------------ admission by real memory


@pytest.fixture(scope="module")
def suite_api(daemon: Daemon, api_template: str) -> Iterator[httpx.Client]:
    """The suite's daemon, with its default caps (and cgroups or not)."""
    with httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=300
    ) as client:
        yield client


def test_forks_given_more_guest_memory_than_the_host_has_run_on_the_defaults(
    suite_api: httpx.Client,
) -> None:
    """The daemon's default caps admit children by what they really take: more 256 MiB
    forks than the host has RAM for, nominally, all run (100 on a 24 GiB host)."""
    c = suite_api
    total_mib = host_memory.read_meminfo().total_mib
    n = total_mib // GUEST_MIB + 1
    capacity = c.get("/v1/capacity").json()
    assert capacity["memory_reserve_mib"] >= 1024 and capacity["memory_overcommit"] == 4.0
    r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": n})
    assert r.status_code == 201, r.text
    ids = [k["id"] for k in r.json()]
    try:
        assert len(ids) == n and n * GUEST_MIB > total_mib
        capacity = c.get("/v1/capacity").json()
        assert capacity["guest_memory_mib"] >= n * GUEST_MIB
        # What they really hold: their QEMUs' own memory, a small part of their guests'.
        assert 0 < capacity["sandboxes_own_memory_mib"] < n * GUEST_MIB / 2
        assert c.post(f"/v1/sandboxes/{ids[-1]}/exec", json={"args": ["true"]}).status_code == 200
    finally:
        for sid in ids:
            c.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture
def reserved(image: Any) -> Iterator[tuple[Daemon, httpx.Client]]:
    """A daemon that keeps all but 64 MiB of what the host has available now in reserve."""
    root = Path(tempfile.mkdtemp(prefix="forkd-m-", dir="/tmp"))
    d = Daemon(root)
    available = host_memory.read_meminfo().available_mib
    d.start("--pool-size", "0", "--memory-reserve", str(available - 64))
    with httpx.Client(
        base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=120
    ) as client:
        yield d, client
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def test_a_request_the_host_s_memory_cannot_hold_is_refused_and_starts_nothing(
    reserved: tuple[Daemon, httpx.Client],
) -> None:
    d, client = reserved
    r = client.post("/v1/snapshots", json={"tag": "big", "memory_mib": 512})
    assert r.status_code == 429, r.text
    said = r.json()["error"]
    assert "needs about 512 MiB of host memory (512 MiB of a template's guest)" in said
    assert "(--memory-reserve)" in said and "short by" in said
    assert client.get("/v1/snapshots").json() == [] and d.qemu_pids() == []
