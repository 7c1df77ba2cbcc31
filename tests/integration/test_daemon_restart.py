"""A restarted daemon finds its snapshots, re-adopts live VMs and leaks none."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.guest import image as images
from forkd.vmm.jail import qemu_user
from forkd.vmm.qemu import host_processes

from .conftest import Daemon

pytestmark = pytest.mark.integration
# This test's own QEMU uids: it rewrites their entries in the host's registry.
UIDS = "99900-99903"


@pytest.fixture
def own_daemon(image: images.Image) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-r-", dir="/tmp"))
    d = Daemon(root)
    d.start("--pool-size", "0", "--vm-uid-range", UIDS)  # exact process counts below
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def _api(d: Daemon) -> httpx.Client:
    return httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=120)


def test_restart_after_sigterm_and_kill_9(own_daemon: Daemon) -> None:
    d = own_daemon
    with _api(d) as c:
        r = c.post("/v1/snapshots", json={"tag": "rt", "memory_mib": 256})
        assert r.status_code == 201, r.text
        a, b = (
            s["id"] for s in c.post("/v1/sandboxes", json={"snapshot_tag": "rt", "n": 2}).json()
        )
        assert c.post(f"/v1/sandboxes/{a}/eval", json={"code": "y = 7"}).json()["error"] is None
        pid_b = c.get(f"/v1/sandboxes/{b}").json()["pid"]
        assert c.post(f"/v1/sandboxes/{a}/branch", json={"tag": "rt-branch"}).status_code == 201

    # SIGTERM: the daemon goes, its sandboxes stay for the next one.
    d.stop(signal.SIGTERM)
    assert len(d.qemu_pids()) == 2
    os.kill(pid_b, signal.SIGKILL)  # b dies while no daemon watches

    d.start("--pool-size", "0", "--vm-uid-range", UIDS)
    with _api(d) as c:
        tags = {s["tag"] for s in c.get("/v1/snapshots").json()}
        assert {"rt", "rt-branch"} <= tags
        assert c.post(f"/v1/sandboxes/{a}/eval", json={"code": "y"}).json()["result"] == "7"
        assert c.post(f"/v1/sandboxes/{a}/exec", json={"args": ["true"]}).json()["exit_code"] == 0
        assert c.get(f"/v1/sandboxes/{b}").status_code == 404
        assert not (d.state_dir / "run" / b).exists()
        assert len(d.qemu_pids()) == 1
        # The branch number is persisted: the next default tag does not reuse 1.
        nxt = c.post(f"/v1/sandboxes/{a}/branch", json={}).json()["tag"]
        assert nxt == f"branch-{a}-1"
        uid_a = host_processes.owner_uid(c.get(f"/v1/sandboxes/{a}").json()["pid"])

    # kill -9 of the daemon itself: same outcome. And the registry of QEMU uids
    # lost a's entry meanwhile (a wiped /run, say), with a's uid next in turn:
    # the next daemon takes it back from a's live QEMU as it adopts it.
    d.stop(signal.SIGKILL)
    (qemu_user.REGISTRY_DIR / str(uid_a)).unlink()
    (qemu_user.REGISTRY_DIR / f".next.{UIDS}").write_text(f"{uid_a}\n")
    d.start("--pool-size", "0", "--vm-uid-range", UIDS)
    with _api(d) as c:
        assert c.post(f"/v1/sandboxes/{a}/eval", json={"code": "y"}).json()["result"] == "7"
        nxt2 = c.post(f"/v1/sandboxes/{a}/branch", json={}).json()["tag"]
        assert nxt2 == f"branch-{a}-2"
        c2 = c.post("/v1/sandboxes", json={"snapshot_tag": "rt-branch"}).json()[0]["id"]
        assert c.post(f"/v1/sandboxes/{c2}/eval", json={"code": "y"}).json()["result"] == "7"
        uid_c2 = host_processes.owner_uid(c.get(f"/v1/sandboxes/{c2}").json()["pid"])
        assert uid_c2 != uid_a and uid_c2 in qemu_user.UidRange.parse(UIDS)
        assert sorted(d.qemu_pids()) == sorted(
            c.get(f"/v1/sandboxes/{s}").json()["pid"] for s in (a, c2)
        )

    # A second daemon on the same state directory refuses to start.
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "serve",
            "--bind",
            "127.0.0.1:1",
            "--state-dir",
            str(d.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode != 0
    assert "another forkd daemon" in second.stderr

    with _api(d) as c:
        for s in (a, c2):
            assert c.delete(f"/v1/sandboxes/{s}").status_code == 204
    assert d.qemu_pids() == []


def test_fork_pool(image: images.Image) -> None:
    """Forks take a QEMU started ahead of time; the pool never outlives its snapshot."""
    root = Path(tempfile.mkdtemp(prefix="forkd-p-", dir="/tmp"))
    d = Daemon(root)
    try:
        d.start("--pool-size", "1")
        with _api(d) as c:
            assert c.post("/v1/snapshots", json={"tag": "pl", "memory_mib": 256}).status_code == 201
            (first,) = c.post("/v1/sandboxes", json={"snapshot_tag": "pl"}).json()
            _wait_for_pool(c, 1)
            waiting = set(d.qemu_pids()) - {first["pid"]}
            (second,) = c.post("/v1/sandboxes", json={"snapshot_tag": "pl"}).json()
            assert {second["pid"]} == waiting  # the pre-started process became the sandbox
            assert (
                c.post(f"/v1/sandboxes/{second['id']}/eval", json={"code": "1 + 1"}).json()[
                    "result"
                ]
                == "2"
            )
            _wait_for_pool(c, 1)  # refilled
            assert c.delete("/v1/snapshots/pl").status_code == 204
            assert set(d.qemu_pids()) == {first["pid"], second["pid"]}  # pool dropped
        d.stop(signal.SIGTERM)
        assert set(d.qemu_pids()) == {first["pid"], second["pid"]}
    finally:
        d.stop()
        d.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_pool(c: httpx.Client, count: int) -> None:
    import re
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"^forkd_pool_waiting (\S+)$", c.get("/metrics").text, re.M)
        if m and float(m.group(1)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the pool never had {count} waiting QEMU")
