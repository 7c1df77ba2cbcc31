"""``forkd exec`` (streaming), ``forkd top`` and ``forkd kill`` against the real app over the
fake driver, under a real uvicorn on loopback (the fake guest's scripts: fake_processes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forkd.client import Controller
from tests.unit.conftest import Invoke, RecordingTransport, Server, env_of, make_app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)


def test_exec_prints_output_as_it_comes(server: Server, sid: str) -> None:
    """The real CLI in a subprocess: the first line is out long before the command ends."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "forkd.cli", "exec", sid, "--", "count", "3", "0.5"],
        stdout=subprocess.PIPE,
        env={**os.environ, **env_of(server)},
    )
    assert cli.stdout is not None
    t0 = time.monotonic()
    first = cli.stdout.readline()
    first_at = time.monotonic() - t0
    rest = cli.stdout.read()
    assert cli.wait(10) == 0
    assert (first, rest) == (b"1\n", b"2\n3\n")
    assert time.monotonic() - t0 - first_at > 0.8  # the rest came a second later


def test_exec_streams_stderr_and_bytes_and_exits_with_the_code(forkd: Invoke, sid: str) -> None:
    res = forkd("exec", sid, "--", "exit", "7")
    assert (res.exit_code, res.stdout, res.stderr) == (7, "", "exit 7\n")
    res = forkd("exec", sid, "--", "hex", "ff00")
    assert res.exit_code == 0 and res.stdout_bytes == b"\xff\x00"
    res = forkd("exec", "--timeout", "0.2", sid, "--", "sleep", "30")
    assert res.exit_code == 124
    res = forkd("exec", sid, "--env", "novalue", "--", "true")
    assert res.exit_code == 2 and "KEY=VALUE" in res.stderr
    res = forkd("exec", sid, "--", "nosuch")
    assert res.exit_code == 1 and "No such file" in res.stderr


def test_exec_json_stays_one_buffered_answer(
    forkd: Invoke, sent: RecordingTransport, sid: str
) -> None:
    res = forkd("exec", sid, "--json", "--cwd", "/", "--", "exit", "3")
    assert res.exit_code == 3 and json.loads(res.stdout)["exit_code"] == 3
    assert sent.last.url.path.endswith("/exec")
    assert sent.body() == {"args": ["exit", "3"], "timeout_secs": 30.0, "cwd": "/"}


def test_top_and_kill(forkd: Invoke, ctl: Controller, sid: str) -> None:
    res = forkd("top", sid)
    assert res.exit_code == 0 and "no processes" in res.stderr
    sleeper = ctl.start_process(sid, ["sleep", "30"])
    done = ctl.start_process(sid, ["echo", "x"])
    res = forkd("top", sid)
    assert res.exit_code == 0
    assert "sleep 30" in res.stdout and "running" in res.stdout and "exited 0" in res.stdout
    listed = json.loads(forkd("top", sid, "--json").stdout)
    assert [p["pid"] for p in listed] == [sleeper["pid"], done["pid"]]

    res = forkd("kill", sid, str(sleeper["pid"]), "--signal", "KILL")
    assert res.exit_code == 0 and f"sent KILL to {sleeper['pid']}" in res.stdout
    assert ctl.get_process(sid, sleeper["pid"])["exit_code"] == 137
    other = ctl.start_process(sid, ["sleep", "30"])
    assert forkd("kill", sid, str(other["pid"]), "-s", "2").exit_code == 0
    assert ctl.get_process(sid, other["pid"])["exit_code"] == 130
    res = forkd("kill", sid, "4242")
    assert res.exit_code == 1 and "4242" in res.stderr
    res = forkd("kill", sid, str(other["pid"]), "--signal", "NOPE!")
    assert res.exit_code == 1 and "signal" in res.stderr


def test_a_guests_command_line_cannot_drive_the_terminal(
    forkd: Invoke, ctl: Controller, sid: str
) -> None:
    """What the guest chose (here a command line) is listed with the terminal's controls
    written out: no escape sequence reaches the user's terminal (OSC 52 would set its
    clipboard, CSI 2J clear it), no carriage return hides a line, no rich markup applies."""
    ctl.start_process(sid, ["echo", "\x1b]52;c;ZXZpbA==\x07", "\x1b[2J\rhidden", "[red]x[/]"])
    res = forkd("top", sid)
    assert res.exit_code == 0
    assert "\x1b" not in res.stdout and "\r" not in res.stdout and "\x07" not in res.stdout
    assert "\\x1b]52;c;ZXZpbA==\\x07" in res.stdout and "\\x1b[2J\\x0dhidden" in res.stdout
    assert "[red]x[/]" in res.stdout


def test_a_shell_line_given_as_one_argument_is_told_to_use_sh_c(forkd: Invoke, sid: str) -> None:
    """Issue 36: ``forkd exec ID -- 'echo x > f'`` failed with only "No such file or
    directory: 'echo x > f'"."""
    result = forkd("exec", sid, "--", "echo x > f")
    assert f"forkd exec {sid} --sh 'echo x > f'" in result.output, result.output
    assert "-- sh -c 'echo x > f'" in result.output
    plain = forkd("exec", sid, "--", "true")
    assert "sh -c" not in plain.output, plain.output


def test_a_wrong_token_says_where_the_token_was_taken_from(server: Server, tmp_path: Path) -> None:
    """Issue 36: with a daemon of another state directory the CLI said only "missing or
    wrong bearer token"."""
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(wrong)}
    result = runner.invoke(make_app(None), ["ps"], env=env)
    assert result.exit_code == 1
    for where in ("missing or wrong bearer token", "FORKD_TOKEN_FILE", "FORKD_STATE_DIR"):
        assert where in result.output, result.output


def test_forkd_version() -> None:
    from forkd import __version__
    from forkd.cli import app

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == __version__
