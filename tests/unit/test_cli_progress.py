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


class _Status:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def update(self, text: str) -> None:
        self.lines.append(text)


COUNTING = [
    "exporting app:1 from the Docker Engine",
    *(f"exported {n}.0 MiB" for n in range(0, 210, 10)),  # the daemon says one every 2 s
    "layer 1/2 sha256:0a1b2c3d4e5f60718… 0.0/120.0 MiB",
    "layer 1/2 sha256:0a1b2c3d4e5f60718… 60.0/120.0 MiB",
    "layer 1/2 sha256:0a1b2c3d4e5f60718… 120.0/120.0 MiB",
    "layer 2/2 sha256:9f8e7d6c5b4a39281… 0.0/80.0 MiB",
    "flattening the image's layers into the root disk",
]


@pytest.mark.parametrize("terminal", [True, False])
def test_an_imports_counts_move_one_line_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: bool
) -> None:
    """Issue 36, item 6: on a terminal a count going up moves the status line only; in a
    log each line the daemon said is kept (it says a count every few seconds)."""
    from forkd.cli import images

    screen = io.StringIO()
    monkeypatch.setattr(images, "err", Console(file=screen, force_terminal=terminal, width=200))
    status = _Status()
    say = images._progress(status, 0.0)  # type: ignore[arg-type]
    for msg in COUNTING:
        say(msg)
    printed = [line for line in screen.getvalue().splitlines() if line.strip()]
    assert len(status.lines) == len(COUNTING)  # the status line follows every step
    if terminal:
        assert len(printed) == 5  # each step once: export, its first count, two layers, flatten
    else:
        assert len(printed) == len(COUNTING)


def test_snapshot_create_shows_each_step_and_what_start_waits_for(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, item 5: a --start that takes a while is not silence: each build step,
    and what is waited for with the service's latest output, come as it goes."""
    from forkd.cli import build_progress
    from forkd.controller.services import template_start

    polls: list[int] = []

    async def listening(template: object, port: int) -> bool:
        polls.append(port)
        return len(polls) >= 4

    monkeypatch.setattr(template_start, "listening", listening)
    monkeypatch.setattr(template_start, "POLL_SECS", 0.2)
    monkeypatch.setattr(template_start, "REPORT_EVERY_SECS", 0.0)
    screen = io.StringIO()
    terminal = Console(file=screen, width=300, force_terminal=True)
    monkeypatch.setattr(build_progress, "err", terminal)
    result = CliRunner().invoke(
        app,
        ["snapshot", "create", "--tag", "web", "--image", "127.0.0.1:5000/team/web:1", "--start"],
        env=env,
    )
    assert result.exit_code == 0, result.output
    said = screen.getvalue()
    assert "booting image oci-" in said and "booted; running 0 setup command(s)" in said
    assert "waiting for port 8080 to listen" in said and "--ready-timeout" in said
    assert "start: waited for port 8080 to listen (the image's one exposed port" in result.stderr
