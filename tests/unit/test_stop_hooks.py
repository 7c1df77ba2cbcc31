"""Stop hooks over the real app (fake VMs): a template's hook taken by its forks and a
branch's by its source's, run before a DELETE (not with force), a timeout and a
hibernation, its output in a ``stop_hook`` event. (The fake guest answers a shell line
with its arguments: a real guest's hook is tests/integration/test_stop_hooks.py's.)"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.unit.conftest import TOKEN, Invoke, Server


def _client(server: Server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"})


def _ran(server: Server, sandbox_id: str) -> list[dict[str, Any]]:
    bus = server.app.state.services.events
    return [e for e in bus.held(sandbox_id) if e["type"] == "stop_hook"]


def test_a_templates_hook_runs_before_each_forks_delete_unless_forced(server: Server) -> None:
    with _client(server) as c:
        c.post(
            "/v1/snapshots", json={"tag": "py", "memory_mib": 128, "on_stop": "echo bye"}
        ).raise_for_status()
        a, b = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 2}).json()
        assert c.delete(f"/v1/sandboxes/{a['id']}").status_code == 204
        [ran] = _ran(server, a["id"])
        assert (ran["reason"], ran["command"], ran["exit_code"]) == ("user", "echo bye", 0)
        assert "echo bye" in ran["output"]  # the fake guest echoes the shell line
        assert c.delete(f"/v1/sandboxes/{b['id']}", params={"force": "true"}).status_code == 204
        assert _ran(server, b["id"]) == []  # force: no hook


def test_a_forks_own_hook_wins_and_a_branch_passes_it_on(server: Server) -> None:
    with _client(server) as c:
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        [plain] = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()
        c.delete(f"/v1/sandboxes/{plain['id']}").raise_for_status()
        assert _ran(server, plain["id"]) == []  # a template without one: none
        body = {"snapshot_tag": "py", "on_stop": "pg_ctl stop", "on_stop_timeout_s": 3}
        [sb] = c.post("/v1/sandboxes", json=body).json()
        branch = c.post(f"/v1/sandboxes/{sb['id']}/branch", json={"tag": "b1"}).json()
        [kid] = c.post("/v1/sandboxes", json={"snapshot_tag": branch["tag"]}).json()
        c.delete(f"/v1/sandboxes/{kid['id']}").raise_for_status()
        [ran] = _ran(server, kid["id"])
        assert ran["command"] == "pg_ctl stop"
        c.post(f"/v1/sandboxes/{sb['id']}/pause", json={"hibernate": True}).raise_for_status()
        [slept] = _ran(server, sb["id"])
        assert slept["reason"] == "hibernate"


def test_a_timeout_runs_the_hook_and_bad_hooks_are_refused(server: Server) -> None:
    with _client(server) as c:
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        body = {"snapshot_tag": "py", "on_stop": "sync", "timeout_s": 0.3}
        [sb] = c.post("/v1/sandboxes", json=body).json()
        deadline = time.monotonic() + 10
        while not _ran(server, sb["id"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        [ran] = _ran(server, sb["id"])
        assert ran["reason"] == "timeout"
        for bad in (
            {"on_stop": ""},
            {"on_stop": "x", "on_stop_timeout_s": 0},
            {"on_stop_timeout_s": 301},
        ):
            refused = c.post("/v1/sandboxes", json={"snapshot_tag": "py", **bad})
            assert refused.status_code == 400, bad


def test_the_cli_gives_forks_and_templates_their_hooks(server: Server, forkd: Invoke) -> None:
    made = forkd("snapshot", "create", "--tag", "hooked", "--on-stop", "echo template")
    assert made.exit_code == 0, made.output
    forked = forkd("fork", "--tag", "hooked", "--json")
    [kid] = json.loads(forked.output)
    mine = forkd(
        "fork", "--tag", "hooked", "--on-stop", "echo mine", "--on-stop-timeout", "2", "--json"
    )
    [own] = json.loads(mine.output)
    with _client(server) as c:
        for sb in (kid, own):
            c.delete(f"/v1/sandboxes/{sb['id']}").raise_for_status()
    assert _ran(server, kid["id"])[0]["command"] == "echo template"
    assert _ran(server, own["id"])[0]["command"] == "echo mine"


def test_rm_force_skips_the_hook(server: Server, forkd: Invoke) -> None:
    with _client(server) as c:
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        a, b = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 2, "on_stop": "x"}).json()
    assert forkd("rm", a["id"]).exit_code == 0
    assert forkd("rm", "--force", b["id"]).exit_code == 0
    assert len(_ran(server, a["id"])) == 1 and _ran(server, b["id"]) == []


def test_a_deleted_templates_hook_is_not_taken_by_one_made_again(server: Server) -> None:
    with _client(server) as c:
        made = {"tag": "py", "memory_mib": 128, "on_stop": "echo old"}
        c.post("/v1/snapshots", json=made).raise_for_status()
        c.delete("/v1/snapshots/py").raise_for_status()
        c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).raise_for_status()
        [sb] = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()
        c.delete(f"/v1/sandboxes/{sb['id']}").raise_for_status()
    assert _ran(server, sb["id"]) == []
    assert server.app.state.services.stop_hooks.of_snapshot("py") is None
