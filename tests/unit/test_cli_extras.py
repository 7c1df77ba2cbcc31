"""The server verbs without ``forkd[server]``: one line saying what to install, exit 1,
and nothing started; with the extra present they run."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from forkd.cli import app, extras


@pytest.mark.parametrize(
    ("verb", "named"),
    [(["serve"], "serve"), (["doctor"], "doctor"), (["image", "build", "python"], "image build")],
)
def test_server_verbs_say_which_extra_is_missing(
    verb: list[str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(extras, "SERVER_MODULES", ("fastapi", "forkd_absent.module", "nope_mod"))
    result = CliRunner().invoke(app, verb)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == [f"forkd {named} needs the server extra: pip install 'forkd[server]'"]


def test_with_the_extra_nothing_is_missing() -> None:
    assert extras.missing_server_modules() == []  # the dev install has it
    assert CliRunner().invoke(app, ["image", "build", "--help"]).exit_code == 0
