"""Secrets through the real daemon app: write-only, sealed at rest, rotated in place,
kept across a restart, and never in an answer, an error, the audit log or the
daemon's log."""

from __future__ import annotations

import io
import logging
import os
import sqlite3
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from forkd.controller import log_redaction
from forkd.controller.app import create_app
from forkd.controller.secret_box import SecretKeyError
from forkd.controller.services.secrets import SecretService
from forkd.controller.settings import Settings
from tests.unit.conftest import TOKEN
from tests.unit.fakes import FakeDriver

VALUE = "sk-live-0123456789abcdef-XYZ"
OPENAI = {"name": "openai", "value": VALUE, "hosts": ["api.openai.com", "*.OpenAI.org."]}


def _app(settings: Settings) -> TestClient:
    app = create_app(settings, TOKEN, driver=FakeDriver())
    return TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"})


def _secrets(client: TestClient) -> SecretService:
    """The daemon's secrets, as its routes use them."""
    app = client.app
    assert isinstance(app, FastAPI)  # as _app and the client fixture make it
    secrets: SecretService = app.state.services.secrets
    return secrets


def _everything_said(client: TestClient, settings: Settings) -> str:
    """Every answer about secrets, and what the daemon wrote in its state dir as text."""
    said = [client.get("/v1/secrets").text, client.get("/v1/secrets/openai").text]
    audit = settings.state_dir / "audit.log"
    said.append(audit.read_text() if audit.exists() else "")
    return "\n".join(said)


def test_a_secret_is_write_only_and_sealed_at_rest(client: TestClient, settings: Settings) -> None:
    made = client.post("/v1/secrets", json=OPENAI)
    assert made.status_code == 201, made.text
    info = made.json()
    assert info["name"] == "openai" and info["last_used_unix"] is None
    assert info["hosts"] == ["api.openai.com", "*.openai.org"]  # canonical
    assert "value" not in info and VALUE not in made.text
    assert [s["name"] for s in client.get("/v1/secrets").json()] == ["openai"]
    assert VALUE not in _everything_said(client, settings)
    for path in settings.state_dir.rglob("*"):  # the database and its WAL hold it sealed
        if path.is_file():
            assert VALUE.encode() not in path.read_bytes(), path
    key = settings.state_dir / "secrets.key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert _secrets(client).value_for("openai", "api.openai.com") == VALUE


def test_a_value_goes_only_to_its_own_hosts(client: TestClient) -> None:
    assert client.post("/v1/secrets", json=OPENAI).status_code == 201
    secrets = _secrets(client)
    assert secrets.value_for("openai", "eu.openai.org") == VALUE  # the wildcard's
    for other in ("openai.org", "api.openai.com.evil.test", "evil.test", "api-openai.com"):
        assert secrets.value_for("openai", other) is None, other
    assert secrets.value_for("nonesuch", "api.openai.com") is None
    used = client.get("/v1/secrets/openai").json()["last_used_unix"]
    assert used is not None  # counted, though not yet flushed to the database


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({**OPENAI, "name": "9lives"}, "name"),
        ({**OPENAI, "name": "a.b"}, "name"),
        ({**OPENAI, "hosts": []}, "hosts"),
        ({**OPENAI, "hosts": ["*"]}, "every host"),
        ({**OPENAI, "hosts": ["203.0.113.9"]}, "names"),
        ({**OPENAI, "hosts": ["not a host"]}, "not a host name"),
        ({**OPENAI, "value": VALUE + "\r\nX-Injected: 1"}, "no CR, LF"),
        ({**OPENAI, "value": VALUE + " "}, "either end"),  # h11 would quote it back
        ({**OPENAI, "value": "\t" + VALUE}, "either end"),
        ({**OPENAI, "value": ""}, "value"),
        ({**OPENAI, "value": VALUE * 400}, "value"),
        ({**OPENAI, "value": 12345678}, "value"),
        ({**OPENAI, "shown": True}, "unknown field"),
    ],
)
def test_a_bad_secret_is_refused_without_repeating_its_value(
    client: TestClient, settings: Settings, body: dict[str, object], says: str
) -> None:
    answer = client.post("/v1/secrets", json=body)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]
    assert VALUE not in answer.text and "X-Injected" not in answer.text
    assert client.get("/v1/secrets").json() == []  # nothing changed


def test_names_are_unique_and_unknown_ones_are_404(client: TestClient) -> None:
    assert client.post("/v1/secrets", json=OPENAI).status_code == 201
    again = client.post("/v1/secrets", json={**OPENAI, "value": "another-value"})
    assert again.status_code == 409 and "PUT /v1/secrets/openai" in again.json()["error"]
    assert _secrets(client).value_for("openai", "api.openai.com") == VALUE
    for method in ("GET", "PUT", "DELETE"):
        answer = client.request(method, "/v1/secrets/nope", json={"value": "v4lue-new"})
        assert answer.status_code == 404, (method, answer.text)


def test_rotation_takes_effect_at_once_and_keeps_what_was_not_changed(
    client: TestClient, settings: Settings
) -> None:
    made = client.post("/v1/secrets", json=OPENAI).json()
    secrets = _secrets(client)
    rotated = client.put("/v1/secrets/openai", json={"value": "sk-rotated-987654321"})
    assert rotated.status_code == 200 and rotated.json()["hosts"] == made["hosts"]
    assert rotated.json()["updated_at_unix"] >= made["updated_at_unix"]
    assert secrets.value_for("openai", "api.openai.com") == "sk-rotated-987654321"
    moved = client.put("/v1/secrets/openai", json={"hosts": ["api.example.com"]})
    assert moved.json()["hosts"] == ["api.example.com"]
    assert secrets.value_for("openai", "api.openai.com") is None
    assert secrets.value_for("openai", "api.example.com") == "sk-rotated-987654321"
    empty = client.put("/v1/secrets/openai", json={})
    assert empty.status_code == 400 and "nothing to change" in empty.json()["error"]
    assert "sk-rotated" not in _everything_said(client, settings)


def test_a_secret_named_by_running_rules_is_kept_unless_forced(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.post("/v1/secrets", json=OPENAI).status_code == 201
    secrets = _secrets(client)
    network = client.app.state.services.network  # type: ignore[attr-defined]
    monkeypatch.setattr(
        network, "rules_naming", lambda name: ["sb-x-0001"] if name == "openai" else []
    )
    refused = client.delete("/v1/secrets/openai")
    assert refused.status_code == 409 and "sb-x-0001" in refused.json()["error"]
    assert client.get("/v1/secrets/openai").status_code == 200
    assert client.delete("/v1/secrets/openai", params={"force": "true"}).status_code == 204
    assert client.get("/v1/secrets/openai").status_code == 404
    assert secrets.value_for("openai", "api.openai.com") is None


def test_a_restarted_daemon_opens_its_secrets(settings: Settings) -> None:
    with _app(settings) as first:
        assert first.post("/v1/secrets", json=OPENAI).status_code == 201
        assert _secrets(first).value_for("openai", "api.openai.com") == VALUE
    with _app(settings) as second:
        secrets = _secrets(second)
        assert secrets.value_for("openai", "api.openai.com") == VALUE
        assert second.get("/v1/secrets/openai").json()["last_used_unix"] is not None  # flushed


def test_a_replaced_key_opens_no_value_but_the_daemon_serves(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with _app(settings) as first:
        assert first.post("/v1/secrets", json=OPENAI).status_code == 201
    key = settings.state_dir / "secrets.key"
    key.unlink()
    with caplog.at_level(logging.ERROR), _app(settings) as second:
        assert second.get("/v1/secrets").json()[0]["name"] == "openai"  # names stay
        assert _secrets(second).value_for("openai", "api.openai.com") is None
        assert any("does not open with the key" in r.getMessage() for r in caplog.records)
        fixed = second.put("/v1/secrets/openai", json={"value": "sk-set-again-1234"})
        assert fixed.status_code == 200
        assert _secrets(second).value_for("openai", "api.openai.com")


def test_an_unsafe_key_file_stops_the_daemon_saying_what_to_fix(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True)
    key = settings.state_dir / "secrets.key"
    key.write_text("A" * 43 + "=\n")
    key.chmod(0o644)
    with pytest.raises(SecretKeyError, match="chmod 600"), _app(settings):
        pass
    key.chmod(0o600)
    key.write_text("too short\n")
    with pytest.raises(SecretKeyError, match="32 bytes"), _app(settings):
        pass


def test_an_operators_key_file_is_used_and_never_made(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = tmp_path / "mounted" / "forkd-secrets.key"
    monkeypatch.setenv("FORKD_SECRETS_KEY_FILE", str(named))
    with pytest.raises(SecretKeyError, match="does not exist"), _app(settings):
        pass
    assert not named.exists()
    named.parent.mkdir()
    fd = os.open(named, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32))  # raw bytes work too
    os.close(fd)
    with _app(settings) as client:
        assert client.post("/v1/secrets", json=OPENAI).status_code == 201
    assert not (settings.state_dir / "secrets.key").exists()
    row = sqlite3.connect(settings.state_dir / "forkd.db").execute("SELECT sealed FROM secrets")
    assert VALUE.encode() not in row.fetchone()[0]


def test_the_daemons_log_never_holds_a_value(client: TestClient) -> None:
    assert client.post("/v1/secrets", json=OPENAI).status_code == 201
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("forkd.test-secret-redaction")
    logger.addHandler(handler)
    logger.propagate = False
    log_redaction.install("forkd.test-secret-redaction")
    try:
        logger.warning("upstream said: %s", ValueError(f"bad header Authorization: {VALUE}"))
        try:
            raise RuntimeError(f"echoed {VALUE}")
        except RuntimeError:
            logger.exception("request failed with %d%%", 50)
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert VALUE not in text
    assert "Authorization: <secret openai>" in text and "echoed <secret openai>" in text
    assert "failed with 50%" in text
