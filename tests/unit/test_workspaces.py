"""Workspaces (the original forkd's /v1/workspaces) over the real app with a fake VM
driver: the original's shapes and codes; suspend hibernates the sandbox and resume wakes
the same one with its state; a workspace whose sandbox is gone is stale and resumes from
its source; a restarted daemon still has them; bad requests change nothing."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from tests.unit.conftest import TOKEN
from tests.unit.fakes import FakeDriver


@pytest.fixture
def template(client: TestClient) -> str:
    r = client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128, "warmup": "x = 41"})
    assert r.status_code == 201, r.text
    return "py"


def _create(client: TestClient, name: str, tag: str = "py", **body: Any) -> Any:
    return client.post("/v1/workspaces", json={"name": name, "snapshot_tag": tag, **body})


def test_create_suspend_resume_delete_in_the_originals_shapes(
    client: TestClient, template: str
) -> None:
    r = _create(client, "w1")
    assert r.status_code == 201, r.text
    ws = r.json()
    sid = ws["live_sandbox_id"]
    assert ws["id"] == f"ws-{sid}" and ws["name"] == "w1"
    assert (ws["status"], ws["source_snapshot_tag"]) == ("running", "py")
    assert "current_state_tag" not in ws  # left out, as the original does until a suspend
    assert ws["last_active_unix"] >= ws["created_at_unix"]
    assert client.get(f"/v1/sandboxes/{sid}").json()["metadata"]["workspace"] == "w1"
    # Its state: set now, found after the suspend and resume.
    client.post(f"/v1/sandboxes/{sid}/eval", json={"code": "x = 99"})

    r = client.post("/v1/workspaces/w1/suspend", json={"diff": False})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "suspended" and "live_sandbox_id" not in r.json()
    assert client.get(f"/v1/sandboxes/{sid}").json()["state"] == "hibernated"
    assert client.post("/v1/workspaces/w1/suspend", json={}).status_code == 400  # not running

    r = client.post("/v1/workspaces/w1/resume", json={})
    assert r.status_code == 200, r.text
    assert (r.json()["status"], r.json()["live_sandbox_id"]) == ("running", sid)
    assert client.post(f"/v1/sandboxes/{sid}/eval", json={"code": "x"}).json()["result"] == "99"
    assert client.post("/v1/workspaces/w1/resume").status_code == 400  # already running

    assert [w["name"] for w in client.get("/v1/workspaces").json()] == ["w1"]
    assert client.get("/v1/workspaces/w1").json()["status"] == "running"
    assert client.delete("/v1/workspaces/w1").status_code == 204
    assert client.get(f"/v1/sandboxes/{sid}").status_code == 404
    assert client.get("/v1/workspaces/w1").status_code == 404
    assert client.get("/v1/snapshots/py").status_code == 200  # the source stays


def test_a_workspace_whose_sandbox_is_gone_is_stale_and_resumes_from_its_source(
    client: TestClient, template: str
) -> None:
    sid = _create(client, "w2").json()["live_sandbox_id"]
    assert client.delete(f"/v1/sandboxes/{sid}").status_code == 204
    ws = client.get("/v1/workspaces/w2").json()
    assert ws["status"] == "stale" and "live_sandbox_id" not in ws
    assert client.post("/v1/workspaces/w2/suspend", json={}).status_code == 400
    r = client.post("/v1/workspaces/w2/resume", json={})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "running" and r.json()["live_sandbox_id"] != sid
    assert client.delete("/v1/workspaces/w2").status_code == 204
    assert client.delete("/v1/workspaces/w2").status_code == 404


def test_a_restarted_daemon_keeps_its_workspaces(
    settings: Settings, template: str, client: TestClient
) -> None:
    sid = _create(client, "w3").json()["live_sandbox_id"]
    assert client.post("/v1/workspaces/w3/suspend", json={}).status_code == 200
    client.__exit__(None, None, None)  # the daemon stops
    app = create_app(settings, TOKEN, driver=FakeDriver())
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as again:
        ws = again.get("/v1/workspaces/w3").json()
        assert (ws["status"], ws["sandbox_id"]) == ("suspended", sid)
        assert again.post("/v1/workspaces/w3/resume", json={}).json()["live_sandbox_id"] == sid


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"name": "no/pe", "snapshot_tag": "py"}, 400, "name"),
        ({"name": "ok", "snapshot_tag": "missing"}, 404, "missing"),
        ({"name": "ok"}, 400, "snapshot_tag"),
        ({"name": "ok", "snapshot_tag": "py", "color": "red"}, 400, "color: unknown field"),
        ({"name": "taken", "snapshot_tag": "py"}, 409, "already exists"),
    ],
)
def test_bad_creates_change_nothing(
    client: TestClient, template: str, body: dict[str, Any], status: int, named: str
) -> None:
    assert _create(client, "taken").status_code == 201
    before = (client.get("/v1/workspaces").json(), client.get("/v1/sandboxes").json())
    r = client.post("/v1/workspaces", json=body)
    assert r.status_code == status, r.text
    assert named in r.json()["error"]
    assert (client.get("/v1/workspaces").json(), client.get("/v1/sandboxes").json()) == before


def test_unknown_workspaces_are_404(client: TestClient) -> None:
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/suspend"), ("POST", "/resume")):
        r = client.request(
            method, f"/v1/workspaces/nope{path}", json={} if method == "POST" else None
        )
        assert r.status_code == 404 and "workspace 'nope' not found" in r.text
