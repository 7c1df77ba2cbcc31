"""The HTTP API of a real daemon process with real VMs: lifecycle and timeouts.

The token and input checks need no VM: tests/unit/test_api_guard.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration


def _client(daemon: Daemon) -> httpx.Client:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    return httpx.Client(base_url=daemon.url, headers=headers, timeout=120)


def test_lifecycle_over_http(daemon: Daemon, api_template: str) -> None:
    with _client(daemon) as c:
        kids = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 3})
        assert kids.status_code == 201, kids.text
        ids = [k["id"] for k in kids.json()]
        assert len(set(ids)) == 3 and all(k["state"] == "running" for k in kids.json())
        for sid in ids:
            assert c.post(f"/v1/sandboxes/{sid}/ping").json()["pong"] is True
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["cat", "/work/setup.txt"]})
            assert r.json() == {**r.json(), "stdout": "ready\n", "exit_code": 0}
            assert (
                c.post(f"/v1/sandboxes/{sid}/eval", json={"code": "x + 1"}).json()["result"] == "42"
            )
        r = c.put(
            f"/v1/sandboxes/{ids[0]}/files", params={"path": "/work/mine"}, content=b"\x00\x01"
        )
        assert r.status_code == 200
        assert c.get(f"/v1/sandboxes/{ids[0]}/files", params={"path": "/work/mine"}).content == (
            b"\x00\x01"
        )
        names = [
            e["name"]
            for e in c.get(f"/v1/sandboxes/{ids[1]}/files/list", params={"path": "/work"}).json()
        ]
        assert "mine" not in names and "setup.txt" in names
        r = c.post(
            f"/v1/sandboxes/{ids[0]}/exec", json={"args": ["sleep", "5"], "timeout_secs": 0.5}
        )
        assert r.json()["exit_code"] == 124
        for sid in ids:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
            assert c.get(f"/v1/sandboxes/{sid}").status_code == 404
        metrics = c.get("/metrics").text
        assert "forkd_snapshots_total" in metrics and 'forkd_build_info{version="' in metrics
    audit = [json.loads(line) for line in (daemon.state_dir / "audit.log").read_text().splitlines()]
    assert any(e["path"] == f"/v1/sandboxes/{ids[0]}/exec" and e["status"] == 200 for e in audit)
    assert daemon.token not in (daemon.state_dir / "audit.log").read_text()


def test_timeout_secs_kills_the_sandbox(daemon: Daemon, api_template: str) -> None:
    with _client(daemon) as c:
        sid = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "timeout_secs": 1}).json()[0][
            "id"
        ]
        deadline = time.monotonic() + 15
        while c.get(f"/v1/sandboxes/{sid}").status_code == 200:
            assert time.monotonic() < deadline, "sandbox outlived its timeout"
            time.sleep(0.2)
    assert not any(
        Path(f"/proc/{p}").exists() and sid.encode() in Path(f"/proc/{p}/cmdline").read_bytes()
        for p in daemon.qemu_pids()
    )
