"""Pause and resume on real VMs: no CPU while paused, a counter that carries on, the
clock set again, a branch of the paused state, and a daemon restart in between;
hibernation: the QEMU gone, a branch of the state on disk, and the sandbox woken
after a daemon restart with its id, address and processes."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.client import CommandHandle, Controller, ControllerError, Sandbox
from forkd.guest import image as images

from .conftest import Daemon
from .counter import COUNTER, Lines, read_until

pytestmark = pytest.mark.integration


def _lines(handle: CommandHandle, count: int, timeout: float = 60) -> Lines:
    """The next ``count`` whole lines of the counter."""
    return read_until(handle, lambda lines: len(lines) >= count, timeout)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_pause_stops_the_cpu_and_a_request_wakes_it_with_the_clock_set(sb: Sandbox) -> None:
    counter = sb.commands.run(COUNTER, background=True)
    before = _lines(counter, 3)
    sb.pause()
    assert sb.refresh()["state"] == "paused"
    pid = int(sb.info["pid"])
    ticks = _cpu_ticks(pid)
    time.sleep(3)
    assert _cpu_ticks(pid) - ticks <= 10, "a paused sandbox used CPU"  # 0.1 s in 3 s at most
    guest_now = float(sb.commands.run("date +%s.%N").stdout)  # resumes it first
    assert sb.refresh()["state"] == "running"
    assert abs(guest_now - time.time()) < 1.5  # it stood still 3 s: set again on resume
    after = _lines(counter, 3)  # from where the handle left off before the pause
    numbers = [n for n, _ in before + after]
    assert numbers == list(range(1, len(numbers) + 1))  # none lost, none repeated
    counter.kill()


def _until_written_by(handle: CommandHandle, host: str, timeout: float = 60) -> tuple[int, int]:
    """The bytes of the stream before its first line written in ``host``, and that
    line's N."""
    text = ""
    deadline = time.monotonic() + timeout
    for stdout, _stderr, _pty in handle:
        text += stdout or ""
        done = 0
        for line in text.split("\n")[:-1]:
            n, written_in = line.split(" ", 1)
            if written_in == host:
                return done, int(n)
            done += len(line) + 1
        assert time.monotonic() < deadline, f"no line of {host} in {text[-200:]!r}"
    raise AssertionError("the counter's output ended")


def test_a_branch_of_a_paused_sandbox_holds_exactly_the_paused_state(sb: Sandbox) -> None:
    counter = sb.commands.run(COUNTER, background=True)
    _lines(counter, 3)
    sb.pause()
    branch = sb.branch()
    try:
        assert branch.info["pause_ms"] == 0 and sb.refresh()["state"] == "paused"
        kid = branch.fork(1)[0]
        try:
            # The child has what the parent wrote up to the pause, then its own lines.
            frozen_bytes, kid_next = _until_written_by(kid.commands.connect(counter.pid), kid.id)
            sb.resume()
            # The parent goes on from that same point with that same value.
            after = _lines(sb.commands.connect(counter.pid, offset=frozen_bytes), 1)
            assert after[0] == (kid_next, sb.id), (after[0], kid_next)
        finally:
            kid.kill()
    finally:
        branch.delete()
        counter.kill()


@pytest.fixture
def own_daemon(image: images.Image) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-p-", dir="/tmp"))
    d = Daemon(root)
    d.start("--pool-size", "0")
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def test_a_paused_sandbox_stays_paused_across_a_daemon_restart(own_daemon: Daemon) -> None:
    d = own_daemon
    with Controller(d.url, token=d.token, timeout=300) as ctl:
        ctl.create_snapshot("pz", memory_mib=256, warmup="x = 5")
        sid = ctl.spawn_sandboxes("pz")[0]["id"]
        ctl.eval_code(sid, "x += 1")
        pid = ctl.pause_sandbox(sid)["pid"]
    d.stop(signal.SIGTERM)
    assert d.qemu_pids() == [pid]  # left for the next daemon, still paused
    d.start("--pool-size", "0")
    with Controller(d.url, token=d.token, timeout=300) as ctl:
        assert ctl.get_sandbox(sid)["state"] == "paused"
        assert ctl.resume_sandbox(sid)["state"] == "running"
        assert ctl.eval_code(sid, "x")["result"] == "6"


def test_a_hibernated_sandbox_wakes_with_its_processes_after_a_daemon_restart(
    own_daemon: Daemon,
) -> None:
    d = own_daemon
    with Controller(d.url, token=d.token, timeout=300) as ctl:
        ctl.create_snapshot("hz", memory_mib=256)
        sb = Sandbox.connect(ctl.spawn_sandboxes("hz")[0]["id"], controller=ctl)
        addr = sb.info["guest_addr"]
        counter = sb.commands.run(COUNTER, background=True)
        before = _lines(counter, 3)
        info = sb.hibernate()
        assert info["state"] == "hibernated" and info["pid"] is None
        assert d.qemu_pids() == []  # its QEMU is gone: its memory is given back
        # A branch of it is its state on disk: no pause, and the counter runs in a fork.
        branch = sb.branch()
        assert branch.info["pause_ms"] == 0
        kid = branch.fork(1)[0]
        kid_lines = _lines(kid.commands.connect(counter.pid), len(before) + 3)
        assert [n for n, _ in kid_lines] == list(range(1, len(kid_lines) + 1))
        kid.kill()
        branch.delete()
    d.stop(signal.SIGTERM)
    d.start("--pool-size", "0")
    with Controller(d.url, token=d.token, timeout=300) as ctl:
        assert ctl.get_sandbox(sb.id)["state"] == "hibernated"
        woken = ctl.resume_sandbox(sb.id)
        assert woken["state"] == "running" and woken["guest_addr"] == addr
        assert len(d.qemu_pids()) == 1
        sb = Sandbox.connect(sb.id, controller=ctl)
        assert [p["pid"] for p in sb.commands.list() if p["running"]] == [counter.pid]
        lines = _lines(sb.commands.connect(counter.pid), len(before) + 3)
        numbers = [n for n, _ in lines]
        assert numbers == list(range(1, len(numbers) + 1))  # none lost, none repeated
        assert {host for _, host in lines} == {sb.id}
        sb.kill()


@pytest.mark.parametrize("action", ["kill", "pause", "hibernate", "branch"])
def test_a_timeout_fires_within_2_s_with_its_action(
    ctl: Controller, api_template: str, action: str
) -> None:
    kid = ctl.spawn_sandboxes(api_template, timeout_s=1, on_timeout=action)[0]
    sid, expiry = kid["id"], kid["expires_at_unix"]
    done = {"kill": None, "pause": "paused", "hibernate": "hibernated", "branch": "dead"}[action]
    while True:
        try:
            state = ctl.get_sandbox(sid)["state"]
        except ControllerError as exc:
            assert exc.status == 404
            state = None
        if state == done:
            break
        assert time.time() - expiry < 10, f"{action} did not happen"
        time.sleep(0.05)
    assert time.time() - expiry < 2.0, f"{action} came {time.time() - expiry:.2f} s late"
    if action == "branch":
        tag = ctl.get_sandbox(sid)["timeout_branch"]
        child = ctl.spawn_sandboxes(tag)[0]["id"]
        assert ctl.eval_code(child, "x")["result"] == "41"  # the template's warm state
        ctl.kill_sandbox(child)
        ctl.delete_snapshot(tag)
    if state is not None:
        ctl.kill_sandbox(sid)


def test_an_idle_timeout_spares_a_sandbox_whose_process_writes(
    ctl: Controller, api_template: str
) -> None:
    quiet, chatty = (s["id"] for s in ctl.spawn_sandboxes(api_template, n=2, idle_timeout_s=2))
    ctl.start_process(chatty, "while :; do echo tick; sleep 0.5; done")
    t0 = time.monotonic()
    while quiet in (listed := {s["id"] for s in ctl.list_sandboxes()}):  # a listing is no use
        assert chatty in listed
        assert time.monotonic() - t0 < 2 + 2.0 + 1, "the idle sandbox was not killed in time"
        time.sleep(0.1)
    time.sleep(3)  # nobody calls it, but its process writes: it is not idle
    assert {s["id"]: s["state"] for s in ctl.list_sandboxes()}.get(chatty) == "running"
    ctl.kill_sandbox(chatty)


# ------------------------------------------------------------------ wake on demand


def _exec(http: httpx.Client, sandbox_id: str, cmd: str) -> httpx.Response:
    return http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"args": ["sh", "-c", cmd]})


@pytest.fixture
def http(daemon: Daemon, api_template: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}, timeout=120
    ) as client:
        yield client


def _together(daemon: Daemon, sandbox_id: str, cmd: str, n: int = 3) -> list[httpx.Response]:
    """``n`` execs of ``cmd`` sent at once, each on a connection of its own."""
    answers: list[httpx.Response] = []
    auth = {"Authorization": f"Bearer {daemon.token}"}

    def one() -> None:
        with httpx.Client(base_url=daemon.url, timeout=120, headers=auth) as client:
            answers.append(_exec(client, sandbox_id, cmd))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


def _wakes_from_hibernation(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('forkd_wakes_total{from="hibernated"}'):
            return float(line.split()[-1])
    return 0.0


def test_requests_to_a_hibernated_sandbox_wake_it_once_with_its_state(
    http: httpx.Client, daemon: Daemon
) -> None:
    sid = http.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
    try:
        assert _exec(http, sid, "echo kept > /tmp/note").status_code == 200
        r = http.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True})
        assert r.status_code == 200 and r.json()["state"] == "hibernated"
        woken_before = _wakes_from_hibernation(http)
        answers = _together(daemon, sid, "cat /tmp/note")
        assert [(a.status_code, a.json()["stdout"]) for a in answers] == [(200, "kept\n")] * 3
        assert any(float(a.headers.get("forkd-wake-ms", 0)) > 0 for a in answers)
        assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        assert _wakes_from_hibernation(http) == woken_before + 1  # one wake for three callers
    finally:
        http.delete(f"/v1/sandboxes/{sid}")


def test_a_sandbox_made_without_auto_resume_stays_asleep_and_says_so(http: httpx.Client) -> None:
    r = http.post("/v1/sandboxes", json={"snapshot_tag": "py", "auto_resume": False})
    sid = r.json()[0]["id"]
    try:
        assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        r = _exec(http, sid, "true")
        assert r.status_code == 409 and "resume it first" in r.json()["error"]
        assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        http.delete(f"/v1/sandboxes/{sid}")


def test_a_wake_that_fails_fails_each_waiting_request_alike_and_it_stays_hibernated(
    http: httpx.Client, daemon: Daemon
) -> None:
    sid = http.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
    try:
        assert http.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
        (saved,) = (daemon.state_dir / "snapshots").glob(f".hibernated.{sid}.*")
        (saved / "vmstate").write_bytes(b"not a device state" * 64)  # its QEMU cannot load it
        answers = _together(daemon, sid, "true")
        said = {(a.status_code, a.json()["error"]) for a in answers}
        assert len(answers) == 3 and len(said) == 1, said  # one wake, one failure for all
        ((status, error),) = said
        assert status >= 500 and f"waking sandbox {sid!r} failed, it stays hibernated" in error
        assert http.get(f"/v1/sandboxes/{sid}").json()["state"] == "hibernated"
    finally:
        http.delete(f"/v1/sandboxes/{sid}")
