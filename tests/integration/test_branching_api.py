"""Branching through the HTTP API with real VMs: trees, isolation, failures."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.guest import image as images

from .conftest import Daemon

pytestmark = pytest.mark.integration


class Api:
    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.c = httpx.Client(
            base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=300
        )

    def fork(self, tag: str, n: int = 1) -> list[str]:
        r = self.c.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": n})
        assert r.status_code == 201, r.text
        return [s["id"] for s in r.json()]

    def branch(self, sid: str, tag: str | None = None) -> dict[str, Any]:
        r = self.c.post(f"/v1/sandboxes/{sid}/branch", json={"tag": tag} if tag else {})
        assert r.status_code == 201, r.text
        return r.json()

    def ev(self, sid: str, code: str) -> Any:
        r = self.c.post(f"/v1/sandboxes/{sid}/eval", json={"code": code}).json()
        assert r["error"] is None, r["error"]
        return r["result"]

    def sh(self, sid: str, cmd: str) -> dict[str, Any]:
        return self.c.post(
            f"/v1/sandboxes/{sid}/exec", json={"args": ["/bin/sh", "-c", cmd]}
        ).json()

    def kill(self, *sids: str) -> None:
        for sid in sids:
            self.c.delete(f"/v1/sandboxes/{sid}")


@pytest.fixture
def api(daemon: Daemon, api_template: str) -> Iterator[Api]:
    a = Api(daemon)
    before = {s["id"] for s in a.c.get("/v1/sandboxes").json()}
    yield a
    after = {s["id"] for s in a.c.get("/v1/sandboxes").json()}
    a.kill(*(after - before))
    a.c.close()


def test_tree_of_branches(api: Api) -> None:
    (child,) = api.fork("py")
    api.ev(child, "path = ['child']")
    b1 = api.branch(child)
    assert b1["branched_from"] == child and b1["pause_ms"] > 0
    assert b1["tag"] == f"branch-{child}-1"
    api.ev(child, "path.append('child-after')")

    grand = api.fork(b1["tag"], 3)
    for i, g in enumerate(grand):
        assert api.ev(g, "path") == "['child']"
        api.ev(g, f"path.append('g{i}')")
    api.sh(grand[0], "echo g0 > /work/g0")

    b2 = api.branch(grand[0], "deep")
    api.ev(grand[0], "path.append('g0-after')")
    great = api.fork("deep", 2)
    for i, gg in enumerate(great):
        assert api.ev(gg, "path") == "['child', 'g0']"
        assert api.sh(gg, "cat /work/g0")["stdout"] == "g0\n"
        api.sh(gg, f"echo {i} > /work/gg")
    info = api.c.get("/v1/snapshots/deep/info").json()
    assert info["parent_tag"] == b1["tag"] and info["ancestors"] == ["py", b1["tag"]]
    assert info["chain_depth"] == 2 and b2["branched_from"] == grand[0]

    # Writes at one node are invisible at its siblings, parent and children.
    assert api.sh(great[1], "cat /work/gg")["stdout"] == "1\n"
    assert api.sh(great[0], "cat /work/gg")["stdout"] == "0\n"
    for other in (grand[0], grand[1], child):
        assert api.sh(other, "cat /work/gg")["exit_code"] != 0
    assert api.sh(grand[1], "cat /work/g0")["exit_code"] != 0
    assert api.ev(grand[0], "path") == "['child', 'g0', 'g0-after']"
    assert api.ev(grand[1], "path") == "['child', 'g1']"
    assert api.ev(child, "path") == "['child', 'child-after']"


def test_two_branches_of_one_child_are_independent(api: Api) -> None:
    (child,) = api.fork("py")
    api.ev(child, "moment = 'A'")
    a = api.branch(child)["tag"]
    api.ev(child, "moment = 'B'")
    b = api.branch(child)["tag"]
    assert (a, b) == (f"branch-{child}-1", f"branch-{child}-2")
    (fa,) = api.fork(a)
    (fb,) = api.fork(b)
    assert api.ev(fa, "moment") == "'A'" and api.ev(fb, "moment") == "'B'"
    api.ev(fa, "moment = 'changed in A'")
    assert api.ev(fb, "moment") == "'B'"
    (fa2,) = api.fork(a)
    assert api.ev(fa2, "moment") == "'A'"


def test_source_keeps_running_through_a_branch(api: Api) -> None:
    (child,) = api.fork("py")
    script = (
        "import time\n"
        "with open('/work/ticks', 'a', buffering=1) as f:\n"
        "    while True:\n"
        "        f.write(f'{time.time()}\\n'); time.sleep(0.1)\n"
    )
    api.c.put(f"/v1/sandboxes/{child}/files", params={"path": "/work/tick.py"}, content=script)
    api.sh(child, "nohup python3 /work/tick.py >/dev/null 2>&1 & echo $! > /work/tick.pid")
    time.sleep(1.0)
    pid = api.sh(child, "cat /work/tick.pid")["stdout"].strip()
    branch = api.branch(child)
    time.sleep(1.0)
    assert api.sh(child, f"kill -0 {pid}")["exit_code"] == 0  # same process, still alive
    ticks = [float(x) for x in api.sh(child, "cat /work/ticks")["stdout"].split()]
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    # The guest's clock stands still while its vCPUs are frozen, so the gap a
    # process inside sees is at most the 100 ms period plus the pause.
    assert len(ticks) >= 12
    assert max(gaps) < 0.1 + branch["pause_ms"] / 1000 + 0.5
    # The grandchild has the ticker's state from the branch moment, running too.
    (g,) = api.fork(branch["tag"])
    n0 = int(api.sh(g, "wc -l < /work/ticks")["stdout"])
    time.sleep(0.5)
    assert int(api.sh(g, "wc -l < /work/ticks")["stdout"]) > n0


def test_branch_outlives_its_source(api: Api) -> None:
    (child,) = api.fork("py")
    api.ev(child, "keep = 'me'")
    tag = api.branch(child)["tag"]
    api.kill(child)
    assert api.c.get(f"/v1/sandboxes/{child}").status_code == 404
    (g,) = api.fork(tag)
    assert api.ev(g, "keep") == "'me'"


def test_kill_9_during_branch(api: Api, daemon: Daemon) -> None:
    (child,) = api.fork("py")
    # Dirty ~120 MiB so the snapshot takes long enough to be hit (of the ~150 MiB a
    # 256 MiB guest has free).
    api.ev(child, "import os\nblob = bytearray(os.urandom(1 << 20)) * 120")
    pid = api.c.get(f"/v1/sandboxes/{child}").json()["pid"]
    snaps = daemon.state_dir / "snapshots"

    def killer() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(p.name.startswith(".doomed.partial-") for p in snaps.iterdir()):
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.001)

    t = threading.Thread(target=killer)
    t.start()
    r = api.c.post(f"/v1/sandboxes/{child}/branch", json={"tag": "doomed"})
    t.join()
    assert r.status_code >= 500, r.text
    assert "error" in r.json()
    assert api.c.get("/v1/snapshots/doomed/info").status_code == 404
    assert not [p for p in snaps.iterdir() if "doomed" in p.name]
    assert api.c.get(f"/v1/sandboxes/{child}").json()["state"] == "dead"


def test_tag_collision_and_unknown_id(api: Api, daemon: Daemon) -> None:
    (child,) = api.fork("py")
    before = sorted(p.name for p in (daemon.state_dir / "snapshots").iterdir())
    r = api.c.post(f"/v1/sandboxes/{child}/branch", json={"tag": "py"})
    assert r.status_code == 409 and "exists" in r.json()["error"]
    r = api.c.post("/v1/sandboxes/sb-none-0001/branch", json={})
    assert r.status_code == 404
    assert sorted(p.name for p in (daemon.state_dir / "snapshots").iterdir()) == before
    assert api.sh(child, "true")["exit_code"] == 0


@contextlib.contextmanager
def _tiny_disk(*args: str) -> Iterator[tuple[Daemon, Path]]:
    """A daemon started with ``args`` whose snapshot root is a 160 MiB tmpfs."""
    root = Path(tempfile.mkdtemp(prefix="forkd-t-", dir="/tmp"))
    snaps = root / "snaps"
    snaps.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160m,mode=0700", "tmpfs", str(snaps)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    d = Daemon(root)
    try:
        d.start("--snapshot-root", str(snaps), "--kill-on-exit", *args)
        yield d, snaps
    finally:
        d.stop()
        d.kill_leftovers()
        subprocess.run(["umount", "-l", str(snaps)], check=False)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tiny_disk_daemon(image: images.Image) -> Iterator[tuple[Daemon, Path]]:
    """A 160 MiB snapshot root: a template fits, a branch not. No reserve
    (``--disk-reserve 0``): the branch starts, and the disk fills under it."""
    with _tiny_disk("--disk-reserve", "0") as started:
        yield started


def test_a_disk_under_the_reserve_refuses_a_template_before_it_boots(
    image: images.Image,
) -> None:
    with _tiny_disk() as (d, snaps):  # the default reserve, 1 GiB, is more than it has
        r = Api(d).c.post("/v1/snapshots", json={"tag": "small", "memory_mib": 256})
        assert r.status_code == 500, r.text
        assert "needs 1024 MiB free" in r.json()["error"], r.text
        assert list(snaps.iterdir()) == []
        assert d.qemu_pids() == []  # refused before a VM started


def test_disk_full_during_branch(tiny_disk_daemon: tuple[Daemon, Path]) -> None:
    d, snaps = tiny_disk_daemon
    api = Api(d)
    r = api.c.post("/v1/snapshots", json={"tag": "small", "memory_mib": 256})
    assert r.status_code == 201, r.text
    (child,) = api.fork("small")
    api.ev(child, "import os\nblob = bytearray(os.urandom(1 << 20)) * 40\nmark = 'before'")
    r = api.c.post(f"/v1/sandboxes/{child}/branch", json={"tag": "nospace"})
    assert r.status_code == 500, r.text
    assert "disk full" in r.json()["error"]
    assert sorted(p.name for p in snaps.iterdir()) == ["small"]
    assert api.c.get("/v1/snapshots/nospace/info").status_code == 404
    assert api.ev(child, "mark") == "'before'"  # resumed and answering
    assert api.c.get(f"/v1/sandboxes/{child}").json()["state"] == "running"
    api.kill(child)


def test_a_child_stays_branchable_after_its_snapshot_is_deleted(api: Api) -> None:
    # The child maps the deleted snapshot's memory.bin: the branch finds that
    # mapping by inode, not by the path that no longer exists.
    base = api.branch(api.fork("py")[0], "doomed-base")
    (child,) = api.fork(base["tag"])
    api.ev(child, "marker = 'survives'")
    assert api.c.delete(f"/v1/snapshots/{base['tag']}").status_code == 204
    grand = api.branch(child)
    (kid,) = api.fork(grand["tag"])
    try:
        assert api.ev(kid, "marker") == "'survives'"
    finally:
        api.kill(child, kid)
        api.c.delete(f"/v1/snapshots/{grand['tag']}")
