"""kill -9 of the daemon in the middle of fork, branch or delete leaves nothing behind.

Fifty rounds on one state directory, seeded (``FORKD_CRASH_SEED``, default
9): start an operation in a thread, SIGKILL the daemon 0-1.5 s later, start
it again. After each restart every QEMU, namespace, host veth and cgroup of
the daemon's VMs belongs to a sandbox it lists as running, no staging
directory is left, and the registry agrees with the disk: each registered
snapshot's directory exists and loads, each snapshot directory is
registered, each running sandbox has its QEMU and answers, and none is left
``starting``. At the end everything is deleted and the daemon stopped:
nothing of it is left. The round-by-round log (what each kill interrupted)
is printed (``-s``) and is the assertion message.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from forkd.client import Controller, ControllerError
from forkd.errors import SnapshotError
from forkd.guest import image as images
from forkd.vmm.snapshot import files as snapshot_files

from .conftest import Daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import leaks  # bench/leaks.py: what a daemon has on the host

pytestmark = pytest.mark.integration

# Kills per run: 20 keep the suite in its budget and still meet each operation about
# seven times; FORKD_CRASH_ROUNDS=200 (and other seeds) for a deeper search.
ROUNDS = int(os.environ.get("FORKD_CRASH_ROUNDS", "20"))
SEED = int(os.environ.get("FORKD_CRASH_SEED", "9"))
MAX_KILL_DELAY_S = 1.5
MAX_RUNNING = 6  # sandboxes kept at once: a fork beyond them becomes a delete
MAX_BRANCHES = 4
SETTLE_S = 3.0  # for QEMUs the restarted daemon just killed to be gone
# --show-host-paths: snapshot files are read where the answers say; a pooled QEMU may be
# caught by the kill too.
SERVE_ARGS = ("--pool-size", "1", "--show-host-paths")
TEMPLATE = "crash"


@dataclass
class Round:
    number: int
    op: str  # fork | branch | delete-sandbox | delete-snapshot
    target: str
    delay_s: float
    outcome: str = "?"  # completed | interrupted | refused: <error>
    problems: tuple[str, ...] = ()

    def line(self) -> str:
        where = f"{self.op} {self.target}"
        found = "; ".join(self.problems) or "consistent"
        return f"{self.number:2d} {where:<42} kill at {self.delay_s:.2f} s: {self.outcome}; {found}"


@pytest.fixture
def crash_daemon(image: images.Image) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-c-", dir="/tmp"))
    d = Daemon(root)
    d.start(*SERVE_ARGS)
    yield d
    d.stop(signal.SIGKILL)
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def _controller(d: Daemon) -> Controller:
    return Controller(d.url, token=d.token, timeout=120)


def _choose(rng: random.Random, number: int, ctl: Controller) -> tuple[str, str, dict]:
    """The round's operation: its name, its target and the arguments of its call."""
    running = sorted(s["id"] for s in ctl.list_sandboxes() if s["state"] == "running")
    branches = sorted(s["tag"] for s in ctl.list_snapshots() if s["tag"] != TEMPLATE)
    op = rng.choice(["fork", "branch", "delete"])
    if op == "fork" and len(running) >= MAX_RUNNING:
        op = "delete"
    if op in ("branch", "delete") and not running:
        op = "fork"
    if op == "delete":
        snapshot = branches and (len(branches) >= MAX_BRANCHES or rng.random() < 0.4)
        op = "delete-snapshot" if snapshot else "delete-sandbox"
    if op == "fork":
        source = TEMPLATE if not branches or rng.random() < 0.6 else rng.choice(branches)
        n = rng.randint(1, 3)
        return op, f"{n} from {source}", {"snapshot_tag": source, "n": n}
    if op == "branch":
        sid = rng.choice(running)
        return op, sid, {"sandbox_id": sid, "tag": f"br-{number}"}
    if op == "delete-snapshot":
        tag = rng.choice(branches)
        return op, tag, {"tag": tag}
    sid = rng.choice(running)
    return op, sid, {"sandbox_id": sid}


CALLS: dict[str, Callable[..., object]] = {
    "fork": Controller.spawn_sandboxes,
    "branch": Controller.branch_sandbox,
    "delete-sandbox": Controller.kill_sandbox,
    "delete-snapshot": Controller.delete_snapshot,
}


def _run_op(d: Daemon, rnd: Round, kwargs: dict) -> None:
    """The round's call; its outcome says whether the kill came first."""
    try:
        with _controller(d) as ctl:
            CALLS[rnd.op](ctl, **kwargs)
        rnd.outcome = "completed"
    except ControllerError as exc:
        rnd.outcome = "interrupted" if exc.unreachable else f"refused: {exc}"


def _problems(d: Daemon, prefix: str, veths_before: set[leaks.Veth]) -> list[str]:
    """Where the daemon's things on the host disagree with what it lists."""
    with _controller(d) as ctl:
        sandboxes = ctl.list_sandboxes()
        snapshots = ctl.list_snapshots()
        running = {s["id"]: s["pid"] for s in sandboxes if s["state"] == "running"}
        silent = []
        for sid in running:
            try:
                ctl.ping_sandbox(sid)
            except ControllerError as exc:
                silent.append(f"running sandbox {sid} does not answer: {exc}")
    c = leaks.take_census(d.state_dir, prefix)
    found = [*silent]
    found += [
        f"QEMU {pid} ({vm}) is no running sandbox's"
        for pid, vm in c.qemu.items()
        if running.get(vm) != pid
    ]
    found += [
        f"running sandbox {sid} has no QEMU"
        for sid, pid in running.items()
        if c.qemu.get(pid) != sid
    ]
    found += [
        f"sandbox {s['id']} is still {s['state']} after the restart"
        for s in sandboxes
        if s["state"] not in ("running", "dead")
    ]
    found += [
        f"namespace {ns} is no running sandbox's"
        for ns in c.netns
        if ns.removeprefix("forkd-") not in running
    ]
    ours = {f"forkd-{sid}" for sid in running}
    found += [
        f"host veth {v.name} (peer in {v.peer_netns}) is no running sandbox's"
        for v in leaks.new_veths(veths_before, leaks.host_veths(), c.foreign_netns)
        if v.peer_netns not in ours
    ]
    found += [f"cgroup {g} is no running sandbox's" for g in c.cgroups if g not in running]
    listed = {s["id"] for s in sandboxes}
    found += [f"run dir entry {e} is no listed sandbox's" for e in c.run_entries if e not in listed]
    found += [f"staging left: {s}" for s in c.staging]
    for s in snapshots:
        try:
            snapshot_files.load(Path(s["dir"]))
        except SnapshotError as exc:
            found.append(f"registered snapshot {s['tag']} does not load: {exc}")
    registered = {Path(s["dir"]).name for s in snapshots}
    found += [f"snapshot dir {n} is not registered" for n in c.snapshot_dirs - registered]
    return sorted(found)


def _settled_problems(d: Daemon, prefix: str, veths_before: set[leaks.Veth]) -> list[str]:
    """The problems left once QEMUs the restarted daemon killed had time to go."""
    deadline = time.monotonic() + SETTLE_S
    while (found := _problems(d, prefix, veths_before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def test_kill_9_during_fork_branch_delete_leaks_nothing(crash_daemon: Daemon) -> None:
    d = crash_daemon
    prefix = leaks.id_prefix(d.state_dir)
    assert prefix
    veths_before = leaks.host_veths()
    with _controller(d) as ctl:
        ctl.create_snapshot(TEMPLATE, memory_mib=256, warmup="x = 41")
    rng = random.Random(SEED)
    rounds: list[Round] = []
    for number in range(1, ROUNDS + 1):
        with _controller(d) as ctl:
            op, target, kwargs = _choose(rng, number, ctl)
        rnd = Round(number, op, target, round(rng.uniform(0, MAX_KILL_DELAY_S), 2))
        worker = threading.Thread(target=_run_op, args=(d, rnd, kwargs))
        worker.start()
        time.sleep(rnd.delay_s)
        d.stop(signal.SIGKILL)
        worker.join(60)
        d.start(*SERVE_ARGS)
        rnd.problems = tuple(_settled_problems(d, prefix, veths_before))
        rounds.append(rnd)

    with _controller(d) as ctl:
        for s in ctl.list_sandboxes():
            ctl.kill_sandbox(s["id"])
        for s in sorted(ctl.list_snapshots(), key=lambda s: s["tag"] == TEMPLATE):
            ctl.delete_snapshot(s["tag"])
    d.stop(signal.SIGTERM)  # no --kill-on-exit: a sandbox it still ran would stay, a leak
    time.sleep(0.5)
    end = leaks.take_census(d.state_dir, prefix)
    left = {k: v for k, v in end.names().items() if v}
    new_veths = leaks.new_veths(veths_before, leaks.host_veths(), end.foreign_netns)
    if new_veths:
        left["veths"] = sorted(v.name for v in new_veths)

    tally = Counter((r.op, r.outcome.split(":")[0]) for r in rounds)
    report = "\n".join(
        [
            f"seed {SEED}",
            *(r.line() for r in rounds),
            *(f"{op} {outcome}: {n}" for (op, outcome), n in sorted(tally.items())),
            f"left at the end: {left or 'nothing'}",
        ]
    )
    print(report)
    assert not any(r.problems for r in rounds) and not left, report
