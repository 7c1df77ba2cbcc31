"""The guest agent's ``env_set`` op (E2B's envVars), run on the host: the variables join
the image's environment for every command started from then on, are kept where a
respawned agent reads them back, and a malformed one changes nothing."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

FILES = Path(__file__).resolve().parents[2] / "src" / "forkd" / "guest" / "files"
if str(FILES) not in sys.path:
    sys.path.insert(0, str(FILES))
handlers = importlib.import_module("forkd_agent_handlers")
command = importlib.import_module("forkd_agent_command")
identity = importlib.import_module("forkd_identity")
params = importlib.import_module("forkd_agent_params")


def test_env_set_adds_to_the_images_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = tmp_path / "defaults.json"
    monkeypatch.setattr(identity, "DEFAULTS_FILE", str(saved))
    image = identity.ImageDefaults({"PATH": "/usr/bin", "MODE": "old"}, "/work", "app")
    monkeypatch.setattr(command, "IMAGE_DEFAULTS", image)
    assert handlers.op_env_set({"env": {"MODE": "new", "TOKEN_NAME": "x"}}) == {}
    now = command.IMAGE_DEFAULTS
    assert now.env == {"PATH": "/usr/bin", "MODE": "new", "TOKEN_NAME": "x"}
    assert (now.cwd, now.user) == ("/work", "app")  # the rest of the image's defaults kept
    assert json.loads(saved.read_text())["env"]["MODE"] == "new"  # for a respawned agent
    assert command.env({}, "/root")["MODE"] == "new"  # what the next command starts with
    for bad in ({"A=B": "x"}, {"": "x"}, {"A": 1}, {"A": "x\0y"}, "A=1"):
        with pytest.raises(params.RequestError):
            handlers.op_env_set({"env": bad})
    assert command.IMAGE_DEFAULTS is now  # refused: nothing changed


def test_env_set_with_cwd_and_user_makes_them_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An E2B template's WORKDIR and USER: the defaults of every later command."""
    saved = tmp_path / "defaults.json"
    monkeypatch.setattr(identity, "DEFAULTS_FILE", str(saved))
    image = identity.ImageDefaults({"PATH": "/usr/bin"}, "/work", "app")
    monkeypatch.setattr(command, "IMAGE_DEFAULTS", image)
    handlers.op_env_set({"env": {}, "cwd": "/srv/app"})
    assert (command.IMAGE_DEFAULTS.cwd, command.IMAGE_DEFAULTS.user) == ("/srv/app", "app")
    handlers.op_env_set({"env": {"A": "1"}, "user": "root"})
    now = command.IMAGE_DEFAULTS
    assert (now.env, now.cwd, now.user) == ({"PATH": "/usr/bin", "A": "1"}, "/srv/app", "root")
    assert json.loads(saved.read_text())["cwd"] == "/srv/app"
    for bad in ({"cwd": "relative"}, {"cwd": 3}, {"user": ""}, {"user": "a\0b"}):
        with pytest.raises(params.RequestError):
            handlers.op_env_set({"env": {}, **bad})
    assert command.IMAGE_DEFAULTS is now
