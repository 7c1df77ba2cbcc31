"""E2B's own Python SDK (``e2b``, pinned in pyproject) against forkd's E2B port: the
daemon runs with fake VMs, both apps under a real uvicorn, the SDK unchanged, pointed
at the port by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY as a user would."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import e2b  # E2B's SDK, as its users have it (a dev dependency, pinned)
import httpx
import pytest

from forkd.controller.settings import Settings
from forkd.e2b_key import e2b_key
from tests.unit.conftest import TOKEN, Server
from tests.unit.e2b_port import UPLOAD_LIMIT
from tests.unit.e2b_port import forkd_client as _forkd


def test_a_sandbox_made_through_e2b_is_a_forkd_sandbox_and_dies_by_e2b(
    server: Server, e2b_url: str
) -> None:
    sbx = e2b.Sandbox.create("base", timeout=120, metadata={"team": "a"})
    with _forkd(server) as c:
        mine = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert mine["state"] == "running" and mine["snapshot_tag"] == "base"
    assert (
        mine["metadata"] == {"team": "a"}
        and 110 < mine["expires_at_unix"] - mine["created_at_unix"] <= 121
    )
    info = sbx.get_info()
    assert (info.sandbox_id, info.template_id, info.metadata) == (
        sbx.sandbox_id,
        "base",
        {"team": "a"},
    )
    assert info.memory_mb == 128 and info.cpu_count >= 1
    sbx.set_timeout(600)
    with _forkd(server) as c:
        later = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert later["expires_at_unix"] > mine["expires_at_unix"] + 400
    assert sbx.kill() is True
    with _forkd(server) as c:
        assert c.get(f"/v1/sandboxes/{sbx.sandbox_id}").status_code == 404  # killed: gone
    assert e2b.Sandbox.kill(sbx.sandbox_id) is False  # gone: E2B's SDK says so
    with pytest.raises(e2b.NotFoundException):
        sbx.get_info()


def test_the_default_lifetime_is_e2bs_five_minutes(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    with _forkd(server) as c:
        row = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert 290 < row["expires_at_unix"] - row["created_at_unix"] <= 301
    assert row["on_timeout"] == "kill"
    sbx.kill()


def test_listing_filters_by_state_and_metadata_and_pages(server: Server, e2b_url: str) -> None:
    made = [e2b.Sandbox.create("base", metadata={"n": str(i % 2)}) for i in range(3)]
    made[0].pause()
    paused = e2b.Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED]))
    assert [s.sandbox_id for s in paused.next_items()] == [made[0].sandbox_id]
    odd = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"n": "1"})).next_items()
    assert [s.sandbox_id for s in odd] == [made[1].sandbox_id]
    pages = e2b.Sandbox.list(limit=2)
    seen = pages.next_items()
    assert len(seen) == 2 and pages.has_next
    seen += pages.next_items()
    assert sorted(s.sandbox_id for s in seen) == sorted(s.sandbox_id for s in made)
    assert not pages.has_next
    for s in made:
        s.kill()


def test_pause_hibernates_and_connect_wakes_it(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    assert sbx.pause() is True
    with _forkd(server) as c:
        assert c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()["state"] == "hibernated"
    assert sbx.pause() is False  # already paused: E2B's SDK says so
    assert sbx.get_info().state == e2b.SandboxState.PAUSED
    again = e2b.Sandbox.connect(sbx.sandbox_id)
    with _forkd(server) as c:
        assert c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()["state"] == "running"
    again.files.write("/woke", "yes")
    assert again.files.read("/woke") == "yes"
    again.kill()


def test_files_go_both_ways_through_the_sdk(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    info = sbx.files.write("/work/notes.txt", "hello from e2b\n")
    assert (info.path, info.name) == ("/work/notes.txt", "notes.txt")
    assert sbx.files.read("/work/notes.txt") == "hello from e2b\n"
    big = os.urandom(5 << 20)
    sbx.files.write("/work/big.bin", big)
    assert sbx.files.read("/work/big.bin", format="bytes") == big
    vm = server.driver.vms[-1]
    assert vm.contents.files["/work/big.bin"] == big  # written in the guest, not held here
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/work/missing")
    sbx.kill()


def test_a_wrong_key_is_refused_and_an_e2b_form_key_works(
    server: Server, e2b_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "0" * 40)
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create("base")
    monkeypatch.setenv("E2B_API_KEY", e2b_key(TOKEN))
    e2b.Sandbox.create("base").kill()


def test_an_unknown_template_or_sandbox_is_e2bs_not_found(server: Server, e2b_url: str) -> None:
    with pytest.raises(e2b.SandboxException, match="404"):
        e2b.Sandbox.create("no-such-template")
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.connect("sb-nope-0001")


def test_a_sandbox_takes_its_own_access_token_only(server: Server, e2b_url: str) -> None:
    a, b = e2b.Sandbox.create("base"), e2b.Sandbox.create("base")
    a.files.write("/secret", "a's")
    token_of_b = httpx.get(
        f"{e2b_url}/sandboxes/{b.sandbox_id}", headers={"X-API-KEY": TOKEN}
    ).json()["envdAccessToken"]
    asked: dict[str, Any] = {"params": {"path": "/secret"}}
    as_b = {"E2b-Sandbox-Id": a.sandbox_id, "X-Access-Token": token_of_b}
    other = httpx.get(f"{e2b_url}/files", headers=as_b, **asked)
    # Another sandbox's token: "not found", as an unknown id (no answer says which exist).
    unknown = {"E2b-Sandbox-Id": "sb-nope-0001", "X-Access-Token": token_of_b}
    alike = httpx.get(f"{e2b_url}/files", headers=unknown, **asked)
    assert other.status_code == alike.status_code == 502 and "was not found" in other.text
    anon = {"E2b-Sandbox-Id": a.sandbox_id}
    refused = httpx.get(f"{e2b_url}/files", headers=anon, **asked)
    assert refused.status_code == 401 and set(refused.json()) == {"code", "message"}
    a.kill()
    b.kill()


def test_an_upload_past_the_limit_is_refused_and_writes_nothing(
    server: Server, e2b_url: str
) -> None:
    sbx = e2b.Sandbox.create("base")
    token = httpx.get(f"{e2b_url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": TOKEN}).json()[
        "envdAccessToken"
    ]
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token}
    r = httpx.post(
        f"{e2b_url}/files",
        params={"path": "/huge"},
        headers={**headers, "Content-Type": "application/octet-stream"},
        content=b"x" * (UPLOAD_LIMIT + 1),
    )
    assert r.status_code == 413
    assert "/huge" not in server.driver.vms[-1].contents.files
    sbx.kill()


def test_a_killed_sandbox_is_not_running_to_the_sdk(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    assert sbx.is_running() is True
    sbx.kill()
    assert sbx.is_running() is False  # E2B's 502 "was not found", as E2B's proxy says it


def test_the_e2b_port_writes_the_daemons_audit_log(
    server: Server, e2b_url: str, settings: Settings
) -> None:
    sbx = e2b.Sandbox.create("base")
    sbx.kill()
    want = {("POST", "/v2/sandboxes", 201), ("DELETE", f"/sandboxes/{sbx.sandbox_id}", 204)}
    deadline = time.monotonic() + 10  # a line is written once its answer has gone out
    while True:
        text = (settings.state_dir / "audit.log").read_text()
        lines = [json.loads(line) for line in text.splitlines()]
        seen = {(r["method"], r["path"], r["status"]) for r in lines}
        if want <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert want <= seen
    assert TOKEN not in text and "X-API-KEY" not in text


def test_a_bug_answers_e2bs_shape_with_an_error_id_only(
    server: Server, e2b_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"boom in {server.app.state.services.settings.state_dir}")

    monkeypatch.setattr(server.app.state.services.sandboxes, "list", broken)
    r = httpx.get(f"{e2b_url}/v2/sandboxes", headers={"X-API-KEY": TOKEN})
    assert r.status_code == 500 and set(r.json()) == {"code", "message"}
    assert "internal error (id " in r.json()["message"] and "boom" not in r.text
    with pytest.raises(e2b.SandboxException, match="500"):
        e2b.Sandbox.list().next_items()


def test_e2bs_network_option_is_forkds_policy_and_changes_at_run_time(
    server: Server, e2b_url: str
) -> None:
    secret = "${e2b.secrets.api_key}"
    network = {
        "allow_out": ["api.example.com", "*.pypi.org"],
        "deny_out": ["evil.example.com"],
        "rules": {"api.example.com": [{"transform": {"headers": {"Authorization": secret}}}]},
    }
    sbx = e2b.Sandbox.create("base", network=network)  # type: ignore[arg-type]
    with _forkd(server) as c:
        policy = c.get(f"/v1/sandboxes/{sbx.sandbox_id}/network").json()
    assert policy["allow_out"] == ["api.example.com", "*.pypi.org"]
    assert policy["deny_out"] == ["evil.example.com"]
    [rule] = policy["rules"]["api.example.com"]
    assert rule["transform"]["headers"]["Authorization"] == "${secrets.api_key}"
    sbx.update_network({"allow_out": ["other.example.com"]})
    with _forkd(server) as c:
        later = c.get(f"/v1/sandboxes/{sbx.sandbox_id}/network").json()
    assert later["allow_out"] == ["other.example.com"]
    socks = {"egress_proxy": {"address": "127.0.0.1:1080"}}
    with pytest.raises(e2b.SandboxException, match="egressProxy"):  # forkd cannot: refused
        e2b.Sandbox.create("base", network=socks)  # type: ignore[arg-type]
    sbx.kill()


def test_metrics_are_forkds_reading_as_e2bs_series(server: Server, e2b_url: str) -> None:
    import datetime

    sbx = e2b.Sandbox.create("base")
    [metric] = sbx.get_metrics()
    assert metric.cpu_count >= 1 and metric.mem_total >= 0 and metric.disk_total >= 0
    assert abs(metric.timestamp.timestamp() - time.time()) < 60
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    assert sbx.get_metrics(start=later) == []  # a window that does not hold now
    sbx.kill()


def test_env_vars_at_create_are_the_sandboxs_environment(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base", envs={"APP_MODE": "test", "LEVEL": "3"})
    vm = next(v for v in server.driver.vms if v.id == sbx.sandbox_id)
    env = vm.contents.defaults["env"]  # the guest's own: every command, fork and branch has it
    assert (env["APP_MODE"], env["LEVEL"]) == ("test", "3")
    sbx.kill()
    with _forkd(server) as c:
        before = len(c.get("/v1/sandboxes").json())
    with pytest.raises(e2b.SandboxException, match="not a variable name"):
        e2b.Sandbox.create("base", envs={"A=B": "x"})
    with _forkd(server) as c:
        assert len(c.get("/v1/sandboxes").json()) == before  # refused: nothing made


def test_what_forkd_does_not_serve_at_create_is_refused_not_dropped(
    server: Server, e2b_url: str
) -> None:
    key = {"X-API-KEY": TOKEN}
    extras: list[dict[str, Any]] = [
        {"mcp": {"github": {}}},
        {"iam": {"aws": {}}},
    ]
    for extra in extras:
        body = {"templateID": "base", "metadata": {}, "envVars": {}, **extra}
        refused = httpx.post(f"{e2b_url}/v2/sandboxes", json=body, headers=key)
        assert refused.status_code == 400, refused.text
        assert next(iter(extra)) in refused.json()["message"]
    with _forkd(server) as c:
        assert c.get("/v1/sandboxes").json() == []  # nothing made


def test_a_refresh_keeps_a_sandbox_alive_never_shorter(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base", timeout=10)
    key = {"X-API-KEY": TOKEN}
    url = f"{e2b_url}/sandboxes/{sbx.sandbox_id}/refreshes"
    assert httpx.post(url, json={"duration": 600}, headers=key).status_code == 204
    with _forkd(server) as c:
        row = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert 590 < row["expires_at_unix"] - time.time() <= 601
    assert httpx.post(url, json={"duration": 5}, headers=key).status_code == 204
    with _forkd(server) as c:
        again = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
    assert again["expires_at_unix"] >= row["expires_at_unix"] - 1  # not made shorter
    sbx.kill()


def test_the_async_sdk_drives_commands_and_files(e2b_url: str) -> None:
    import asyncio

    async def run() -> tuple[str, bytes, list[str]]:
        sbx = await e2b.AsyncSandbox.create("base")
        ran = await sbx.commands.run("echo from async")
        await sbx.files.write("/work/async.bin", b"\x00\x01")
        data = await sbx.files.read("/work/async.bin", format="bytes")
        names = [e.name for e in await sbx.files.list("/work")]
        await sbx.kill()
        return ran.stdout, bytes(data), names

    assert asyncio.run(run()) == ("from async\n", b"\x00\x01", ["async.bin"])
