"""forkd.cli.options.with_options: a command's options declared once, as a dataclass's fields."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from typer.testing import CliRunner

from forkd import cli
from forkd.cli.options import with_options
from forkd.cli.serve_options import ServeOptions

NameOpt = Annotated[str, typer.Option(help="A name.")]
CountOpt = Annotated[int, typer.Option("--count", "-c", min=1)]


@dataclasses.dataclass(frozen=True)
class _Options:
    name: NameOpt = "x"
    count: CountOpt = 1


def test_the_command_takes_the_fields_as_options_and_gets_them_as_one() -> None:
    given: list[_Options] = []

    def greet(options: _Options) -> None:
        """Greet."""
        given.append(options)

    app = typer.Typer()
    app.command()(with_options(greet, _Options))
    result = CliRunner().invoke(app, ["--name", "y", "-c", "3"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 0, result.output
    assert given == [_Options("y", 3), _Options()]
    help_text = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "100"}).output
    assert "Greet." in help_text and "A name." in help_text and "--count" in help_text
    result = CliRunner().invoke(app, ["-c", "0"])
    assert result.exit_code == 2 and given == [_Options("y", 3), _Options()]  # min=1 holds


def test_forkd_serve_has_an_option_for_each_field_of_serve_options_in_order() -> None:
    serve = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]  # a group's
    fields = dataclasses.fields(ServeOptions)
    assert [p.name for p in serve.params] == [f.name for f in fields]
    assert [p.default for p in serve.params] == [f.default for f in fields]
    assert serve.help.startswith("Run the forkd daemon")
