"""``forkd secret`` and the SDK's secret routes against the real daemon app: a value
comes from a file, stdin or the environment (never an argument) and is never
printed back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from forkd.client import AsyncController, Controller, ControllerError
from tests.unit.conftest import RecordingTransport, Server, env_of, make_app

runner = CliRunner()
Invoke = Callable[..., Result]
VALUE = "ghp_0123456789abcdefghijklmnop"


@pytest.fixture
def forkd(server: Server, sent: RecordingTransport) -> Invoke:
    app = make_app(sent)

    def invoke(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> Result:
        return runner.invoke(app, list(args), input=stdin, env={**env_of(server), **(env or {})})

    return invoke


def test_create_from_a_file_drops_one_newline_and_prints_no_value(
    forkd: Invoke, ctl: Controller, tmp_path: Path, sent: RecordingTransport
) -> None:
    key = tmp_path / "key.txt"
    key.write_text(VALUE + "\n")
    res = forkd(
        "secret",
        "create",
        "github",
        "--value-file",
        str(key),
        "--host",
        "*.github.com",
        "--host",
        "github.com",
    )
    assert res.exit_code == 0, res.output
    assert VALUE not in res.output and "*.github.com" in res.output
    assert sent.body(-1) == {
        "name": "github",
        "value": VALUE,
        "hosts": ["*.github.com", "github.com"],
    }
    listed = forkd("secret", "ls")
    assert listed.exit_code == 0 and "github" in listed.output and "never" in listed.output
    assert VALUE not in listed.output


def test_a_value_from_stdin_or_the_environment_and_rotation(
    forkd: Invoke, sent: RecordingTransport
) -> None:
    made = forkd(
        "secret", "create", "pypi", "--value-file", "-", "--host", "pypi.test", stdin=VALUE + "\r\n"
    )
    assert made.exit_code == 0, made.output
    assert sent.body(-1)["value"] == VALUE
    rotated = forkd(
        "secret",
        "update",
        "pypi",
        "--from-env",
        "NEW_KEY",
        "-o",
        "json",
        env={"NEW_KEY": "rotated-value-42"},
    )
    assert rotated.exit_code == 0, rotated.output
    assert sent.body(-1) == {"value": "rotated-value-42"}
    assert '"name": "pypi"' in rotated.output and "rotated-value-42" not in rotated.output
    moved = forkd("secret", "update", "pypi", "--host", "index.pypi.test")
    assert moved.exit_code == 0 and sent.body(-1) == {"hosts": ["index.pypi.test"]}


def test_what_the_cli_refuses(forkd: Invoke, tmp_path: Path) -> None:
    no_hosts = forkd("secret", "create", "x", "--from-env", "HOME")
    assert no_hosts.exit_code == 2 and "--host" in no_hosts.output
    both = forkd(
        "secret", "create", "x", "--host", "a.test", "--from-env", "HOME", "--value-file", "-"
    )
    assert both.exit_code == 2 and "not both" in both.output
    unset = forkd("secret", "create", "x", "--host", "a.test", "--from-env", "NOT_SET_ANYWHERE")
    assert unset.exit_code == 2 and "NOT_SET_ANYWHERE is not set" in unset.output
    missing = forkd(
        "secret", "create", "x", "--host", "a.test", "--value-file", str(tmp_path / "nope")
    )
    assert missing.exit_code == 2 and "cannot read" in missing.output
    no_value = forkd("secret", "create", "x", "--host", "a.test", stdin="")
    assert no_value.exit_code == 2 and "no value" in no_value.output
    bad_host = forkd(
        "secret", "create", "x", "--host", "10.0.0.1", "--value-file", "-", stdin=VALUE
    )
    assert bad_host.exit_code == 1 and "names" in bad_host.output and VALUE not in bad_host.output


def test_rm_says_each_and_fails_on_an_unknown_one(forkd: Invoke, ctl: Controller) -> None:
    ctl.create_secret("a", VALUE, ["a.test"])
    res = forkd("secret", "rm", "a", "nope")
    assert res.exit_code == 1
    assert "deleted secret a" in res.output and "no secret 'nope'" in res.output
    assert ctl.list_secrets() == []


def test_the_sdk_speaks_every_secret_route(ctl: Controller) -> None:
    info = ctl.create_secret("openai", VALUE, ["api.openai.test"])
    assert info["hosts"] == ["api.openai.test"] and "value" not in info
    assert ctl.secret_info("openai")["name"] == "openai"
    assert ctl.update_secret("openai", hosts=["b.test"])["hosts"] == ["b.test"]
    assert [s["name"] for s in ctl.list_secrets()] == ["openai"]
    ctl.delete_secret("openai", force=True)
    with pytest.raises(ControllerError) as gone:
        ctl.secret_info("openai")
    assert gone.value.status == 404


def test_the_async_sdk_has_them_too(server: Server) -> None:
    async def use() -> None:
        async with AsyncController(server.url, token=server.token) as actl:
            await actl.create_secret("k", VALUE, ["k.test"])
            assert [s["name"] for s in await actl.list_secrets()] == ["k"]
            await actl.delete_secret("k")
            assert await actl.list_secrets() == []

    asyncio.run(use())


def test_fork_and_snapshot_create_send_a_network_object_and_an_env(
    forkd: Invoke, ctl: Controller, sent: RecordingTransport
) -> None:
    made = forkd(
        "snapshot",
        "create",
        "--tag",
        "agent",
        "--allow-out",
        "api.openai.com",
        "--allow-out",
        "*.github.com",
        "--deny-out",
        "gist.github.com",
        "--env",
        "OPENAI_API_KEY=${secrets.openai}",
        "--json",
    )
    assert made.exit_code == 0, made.output
    body = next(json.loads(r.content) for r in sent.requests if r.url.path == "/v1/snapshots")
    assert body["network"] == {
        "allow_out": ["api.openai.com", "*.github.com"],
        "deny_out": ["gist.github.com"],
    }
    assert body["env"] == {"OPENAI_API_KEY": "${secrets.openai}"}
    forked = forkd("fork", "--tag", "agent", "--deny-out", "*", "--json")
    assert forked.exit_code == 0, forked.output
    assert sent.body(-1)["network"] == {"deny_out": ["*"]}
    bad = forkd("snapshot", "create", "--tag", "x", "--env", "NOEQUALS")
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
