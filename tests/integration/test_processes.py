"""Background processes against a real daemon and real VMs: output streamed as it is
written, stdin, signals, the 4 MiB ring's gap, terminals, the CLI, and processes that
carry on in every child after a branch and a fork."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from forkd.client import CommandHandle, Controller, ControllerError, Sandbox

from .conftest import Daemon
from .counter import COUNTER, Lines, read_until

pytestmark = pytest.mark.integration


def _lines_until(handle: CommandHandle, done: int, timeout: float = 60) -> Lines:
    """The counter's lines from the handle's offset until N reaches ``done``."""
    return read_until(handle, lambda lines: bool(lines) and lines[-1][0] >= done, timeout)


def test_output_is_streamed_as_it_is_written(sb: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = sb.commands.run(
        "for i in 1 2 3 4; do echo line $i; sleep 1; done",
        on_stdout=lambda s: seen.append((time.monotonic() - t0, s)),
    )
    assert (r.exit_code, r.stdout) == (0, "line 1\nline 2\nline 3\nline 4\n")
    first_at, end_at = seen[0][0], time.monotonic() - t0
    assert seen[0][1].startswith("line 1")
    assert first_at < 2.0 and end_at - first_at > 2.5, (first_at, end_at)


def test_stdin_to_cat(sb: Sandbox) -> None:
    cat = sb.commands.run(["cat"], background=True, stdin=True)
    cat.send_stdin("hello\n")
    first = next(iter(cat))
    assert first == ("hello\n", None, None)
    cat.send_stdin(b"\xff\x00bytes\n")
    cat.close_stdin()
    done = cat.wait()
    assert done.exit_code == 0 and done.stdout.startswith("hello\n")
    events = list(sb.controller.process_output(sb.id, cat.pid))
    assert b"".join(e.data for e in events if e.kind == "stdout") == b"hello\n\xff\x00bytes\n"
    with pytest.raises(ControllerError) as exc:
        cat.send_stdin("late\n")
    assert exc.value.status == 409


def test_list_inspect_and_signal(sb: Sandbox, ctl: Controller) -> None:
    info = ctl.start_process(sb.id, ["sleep", "1000"])
    assert info["running"] and info["cmd"] == ["sleep", "1000"]
    assert info["pid"] in [p["pid"] for p in sb.commands.list()]
    assert ctl.get_process(sb.id, info["pid"])["running"]
    attached = Sandbox.connect(sb.id, controller=ctl)  # another client, by id, as E2B's
    assert (attached.id, attached.snapshot_tag) == (sb.id, sb.snapshot_tag)
    assert info["pid"] in [p["pid"] for p in attached.commands.list()]
    assert list(ctl.process_output(sb.id, info["pid"], follow=False)) == []  # nothing yet
    ctl.signal_process(sb.id, info["pid"], "SIGTERM")
    done = sb.commands.connect(info["pid"]).wait()
    assert done.exit_code == 143
    got = ctl.get_process(sb.id, info["pid"])
    assert not got["running"] and got["exit_code"] == 143 and got["ended_at"] is not None
    with pytest.raises(ControllerError) as exc:
        ctl.get_process(sb.id, 999999)
    assert exc.value.status == 404
    timed = sb.commands.run(["sleep", "1000"], timeout=1, on_stdout=print)
    assert timed.exit_code == 124


def test_a_lost_range_is_a_gap_event(sb: Sandbox, ctl: Controller) -> None:
    info = ctl.start_process(sb.id, "head -c 6000000 /dev/zero | tr '\\0' x")
    while (now := ctl.get_process(sb.id, info["pid"]))["running"]:
        time.sleep(0.2)
    assert now["output_end"] == 6_000_000 and now["output_start"] > 0
    events = list(ctl.process_output(sb.id, info["pid"]))
    assert (events[0].kind, events[0].offset, events[0].next_offset) == (
        "gap",
        0,
        now["output_start"],
    )
    data = [e for e in events if e.kind == "stdout"]
    assert data[0].offset == now["output_start"]
    assert sum(len(e.data) for e in data) == 6_000_000 - now["output_start"]
    assert events[-1].kind == "exit" and events[-1].exit_code == 0


def test_a_terminal_and_its_resize(sb: Sandbox, ctl: Controller) -> None:
    info = ctl.start_process(sb.id, ["sh"], pty=(100, 30))
    assert info["pty"] and info["stdin"]
    ctl.send_stdin(sb.id, info["pid"], "tty; stty size\n")
    seen = b""
    for event in ctl.process_output(sb.id, info["pid"]):
        seen += event.data
        if b"30 100" in seen:
            break
    assert b"/dev/pts/" in seen
    ctl.resize_process(sb.id, info["pid"], 120, 40)
    ctl.send_stdin(sb.id, info["pid"], "stty size; exit 3\n")
    rest = list(ctl.process_output(sb.id, info["pid"], offset=len(seen)))
    assert b"40 120" in b"".join(e.data for e in rest if e.kind == "pty")
    assert rest[-1].kind == "exit" and rest[-1].exit_code == 3


def test_cli_exec_streams_and_exits_with_the_code(daemon: Daemon, sb: Sandbox) -> None:
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forkd.cli",
            "exec",
            sb.id,
            "--",
            "sh",
            "-c",
            "echo first; sleep 3; echo second; exit 5",
        ],
        stdout=subprocess.PIPE,
        env=daemon.env(),
    )
    assert cli.stdout is not None
    t0 = time.monotonic()
    assert cli.stdout.readline() == b"first\n"
    first_at = time.monotonic() - t0
    assert cli.stdout.read() == b"second\n"
    assert cli.wait(30) == 5
    assert time.monotonic() - t0 - first_at > 2.0
    r = _cli(daemon, "top", sb.id, "--json")
    assert any(p["cmd"][-1].startswith("echo first") for p in json.loads(r.stdout))
    sleeper = sb.commands.run(["sleep", "1000"], background=True)
    r = _cli(daemon, "kill", sb.id, str(sleeper.pid), "--signal", "KILL")
    assert r.returncode == 0, r.stderr
    assert sleeper.wait().exit_code == 137
    r = _cli(daemon, "top", sb.id)
    assert r.returncode == 0 and "sleep 1000" in r.stdout and "exited 137" in r.stdout


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forkd.cli", *args],
        capture_output=True,
        text=True,
        env=daemon.env(),
        timeout=60,
    )


def test_a_running_process_carries_on_in_every_fork_of_a_branch(
    sb: Sandbox, ctl: Controller
) -> None:
    counter = sb.commands.run(COUNTER, background=True)
    before = _lines_until(counter, 5)
    assert [n for n, _ in before] == list(range(1, len(before) + 1))
    parent_host = before[0][1]

    read_before = counter.offset
    branch = sb.branch()
    kids = branch.fork(2)
    try:
        branch_value = _lines_until(counter, before[-1][0] + 1)[-1][0]
        assert parent_host == sb.id  # a fork's hostname is its id
        streams = {}
        for kid in kids:
            listed = {p["pid"]: p for p in kid.commands.list()}
            assert listed[counter.pid]["running"], listed
            assert listed[counter.pid]["output_end"] >= read_before
            streams[kid.id] = kid.commands.connect(counter.pid)
        for kid in kids:  # each from the start: the parent's lines, then its own
            lines = _lines_until(streams[kid.id], branch_value + 10)
            assert [n for n, _ in lines] == list(range(1, len(lines) + 1))  # none lost
            hosts = [host for _, host in lines]
            assert hosts[0] == sb.id and hosts[-1] == kid.id
            switch = hosts.index(kid.id)
            assert set(hosts[:switch]) == {sb.id} and set(hosts[switch:]) == {kid.id}
            assert lines[switch][0] <= branch_value + 1  # it went on from the branch

        # Independent: stopping the counter in one child leaves the other's running.
        kids[0].commands.kill(counter.pid)
        assert streams[kids[0].id].wait().exit_code == 137
        assert ctl.get_process(kids[1].id, counter.pid)["running"]
        assert ctl.get_process(sb.id, counter.pid)["running"]
        last = _lines_until(streams[kids[1].id], branch_value + 15)[-1]
        assert last == (last[0], kids[1].id) and last[0] >= branch_value + 15
        # A new reader in a child resumes at an offset without loss.
        resumed = kids[1].commands.connect(counter.pid, offset=streams[kids[1].id].offset)
        assert _lines_until(resumed, last[0] + 1)[0] == (last[0] + 1, kids[1].id)
    finally:
        for kid in kids:
            kid.kill()
        counter.kill()
        branch.delete()
