"""Progress of ``forkd fork -n N`` on a terminal, and none in --json mode or off a terminal."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from forkd.cli import app, fork_progress
from forkd.client import Controller
from tests.unit.conftest import Server


@pytest.fixture
def env(server: Server) -> dict[str, str]:
    with Controller(server.url, token=server.token) as ctl:
        ctl.create_snapshot("py", memory_mib=128)
    return {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}


@pytest.mark.parametrize("terminal", [True, False])
def test_fork_shows_a_bar_on_a_terminal_only(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(fork_progress, "err", Console(file=screen, force_terminal=terminal))
    result = CliRunner().invoke(app, ["fork", "--tag", "py", "-n", "3"], env=env)
    assert result.exit_code == 0, result.output
    assert ("forking from py" in screen.getvalue()) == terminal


def test_json_mode_is_quiet(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(fork_progress, "err", Console(file=screen, force_terminal=True))
    result = CliRunner().invoke(app, ["fork", "--tag", "py", "-n", "2", "--json"], env=env)
    assert result.exit_code == 0
    assert len(json.loads(result.stdout)) == 2 and screen.getvalue() == ""
