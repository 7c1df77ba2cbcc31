"""``forkd shell`` and ``forkd exec -i/-t`` against the real app over the fake driver.

The CLI runs in a real process: under pexpect, on a real pseudo-terminal,
where raw mode and SIGWINCH are those of a user's terminal; or with pipes,
where stdin is not a terminal. The fake guest's ``cat`` echoes what it reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pexpect
import pytest
from typer.testing import CliRunner

from forkd.client import Controller
from forkd.client.pty import LOGIN_SHELL
from tests.unit.conftest import RecordingTransport, Server, env_of, make_app
from tests.unit.fake_processes import FakeProcess


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)


def _env(server: Server) -> dict[str, str]:
    return {**os.environ, **env_of(server), "TERM": "xterm-test"}


def _newest(server: Server, sandbox_id: str, deadline_s: float = 10) -> FakeProcess:
    """The process the CLI started last in the sandbox, once it is there."""
    vm = next(vm for vm in server.driver.vms if vm.id == sandbox_id)
    deadline = time.monotonic() + deadline_s
    while not vm.processes.procs:
        assert time.monotonic() < deadline, "the CLI started no process"
        time.sleep(0.02)
    return vm.processes.procs[max(vm.processes.procs)]


def test_exec_it_is_a_raw_terminal_that_resizes_and_exits_with_the_code(
    server: Server, sid: str, ctl: Controller
) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "forkd.cli", "exec", "-it", sid, "--", "cat"],
        env=_env(server),
        dimensions=(30, 100),
        timeout=10,
    )
    try:
        proc = _newest(server, sid)
        assert proc.pty and proc.size == (100, 30) and proc.cmd == ["cat"]
        child.send("abc\x03")  # raw mode: Ctrl-C is a byte for the guest, not our SIGINT
        child.expect_exact("abc\x03")
        child.setwinsize(40, 120)  # SIGWINCH
        deadline = time.monotonic() + 5
        while proc.size != (120, 40):
            assert time.monotonic() < deadline, proc.size
            time.sleep(0.02)
        ctl.signal_process(sid, proc.pid, "SIGKILL")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 137


def test_shell_starts_a_login_shell_with_our_term(server: Server, sid: str) -> None:
    child = pexpect.spawn(
        sys.executable, ["-m", "forkd.cli", "shell", sid], env=_env(server), timeout=10
    )
    child.expect(pexpect.EOF)  # the fake guest's "shell" prints its arguments and exits 0
    child.close()
    proc = _newest(server, sid)
    assert child.exitstatus == 0 and proc.cmd == LOGIN_SHELL and proc.pty


def test_exec_i_pipes_stdin_with_its_eof(server: Server, sid: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "forkd.cli", "exec", "-i", sid, "--", "cat"],
        input=b"one\ntwo\n",
        capture_output=True,
        env=_env(server),
        timeout=30,
    )
    assert (r.returncode, r.stdout) == (0, b"one\ntwo\n"), r.stderr
    assert not _newest(server, sid).pty


def test_exec_t_without_a_terminal_runs_in_a_default_size_one(server: Server, sid: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "forkd.cli", "exec", "-t", sid, "--", "exit", "3"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=_env(server),
        timeout=30,
    )
    assert r.returncode == 3, r.stderr
    assert r.stdout == b"exit 3\n"  # in a terminal, stderr comes through it
    assert _newest(server, sid).size == (80, 24)


def test_exec_it_with_piped_stdin_says_so_and_types_it(
    server: Server, sid: str, ctl: Controller
) -> None:
    cli = subprocess.Popen(
        [sys.executable, "-m", "forkd.cli", "exec", "-it", sid, "--", "cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(server),
    )
    assert cli.stdin is not None and cli.stdout is not None and cli.stderr is not None
    cli.stdin.write(b"typed\n")
    cli.stdin.close()
    assert cli.stdout.read(7) == b"typed\n\x04"  # then Ctrl-D, as a terminal would send
    proc = _newest(server, sid)
    ctl.signal_process(sid, proc.pid, "SIGTERM")  # the fake cat knows no line discipline
    assert cli.wait(10) == 143
    assert b"stdin is not a terminal" in cli.stderr.read()


def test_exec_json_refuses_i_and_t(server: Server, sid: str, sent: RecordingTransport) -> None:
    res = CliRunner().invoke(
        make_app(sent), ["exec", "-it", "--json", sid, "--", "cat"], env=env_of(server)
    )
    assert res.exit_code == 2 and "cannot go with -i or -t" in res.stderr


def test_keys_typed_before_the_session_is_up_are_not_lost(server: Server, sid: str) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "forkd.cli", "exec", "-it", sid, "--", "cat"],
        env=_env(server),
        timeout=10,
    )
    try:
        child.send("early\r")  # long before forkd has its terminal in raw mode
        proc = _newest(server, sid)
        deadline = time.monotonic() + 10
        while b"early" not in b"".join(data for _s, _o, data in proc.ring):
            assert time.monotonic() < deadline, "the keys typed ahead were flushed"
            time.sleep(0.05)
    finally:
        child.close(force=True)
