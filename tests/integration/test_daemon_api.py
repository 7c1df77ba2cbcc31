"""The HTTP API of a real daemon process with real VMs: auth, bad input, lifecycle."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration


def _client(daemon: Daemon, token: str | None = "ok") -> httpx.Client:
    headers = {}
    if token == "ok":
        headers["Authorization"] = f"Bearer {daemon.token}"
    elif token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=daemon.url, headers=headers, timeout=120)


def _state(daemon: Daemon) -> dict[str, Any]:
    """Everything a bad request must leave unchanged: registry and disk."""
    with _client(daemon) as c:
        snaps = sorted(s["tag"] for s in c.get("/v1/snapshots").json())
        boxes = sorted(b["id"] for b in c.get("/v1/sandboxes").json())
    on_disk = sorted(p.name for p in (daemon.state_dir / "snapshots").iterdir())
    return {"snapshots": snaps, "sandboxes": boxes, "disk": on_disk}


ROUTES = [
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/snapshots"),
    ("POST", "/v1/snapshots"),
    ("GET", "/v1/snapshots/py/info"),
    ("DELETE", "/v1/snapshots/py"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/sb-x-1"),
    ("DELETE", "/v1/sandboxes/sb-x-1"),
    ("POST", "/v1/sandboxes/sb-x-1/ping"),
    ("POST", "/v1/sandboxes/sb-x-1/exec"),
    ("POST", "/v1/sandboxes/sb-x-1/eval"),
    ("POST", "/v1/sandboxes/sb-x-1/branch"),
    ("GET", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("PUT", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("DELETE", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("GET", "/v1/sandboxes/sb-x-1/files/list?path=/"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_route_but_healthz_needs_the_token(
    daemon: Daemon, api_template: str, token: str | None
) -> None:
    before = _state(daemon)
    with _client(daemon, token) as c:
        assert c.get("/healthz").json() == {"ok": True}
        for method, path in ROUTES:
            r = c.request(method, path, json={} if method in ("POST", "PUT") else None)
            assert r.status_code == 401, (method, path, r.status_code)
            assert "error" in r.json()
    assert _state(daemon) == before


BAD_TAGS = ["../x", "", "a" * 65, "has space", "x/y", "é"]


def test_bad_input_is_refused_and_changes_nothing(daemon: Daemon, api_template: str) -> None:
    before = _state(daemon)
    with _client(daemon) as c:
        box = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
        before = _state(daemon)
        cases: list[tuple[str, str, dict[str, Any], Any, int]] = []
        for tag in BAD_TAGS:
            cases += [
                ("POST", "/v1/snapshots", {}, {"tag": tag}, 400),
                ("POST", "/v1/sandboxes", {}, {"snapshot_tag": tag}, 400),
                ("POST", f"/v1/sandboxes/{box}/branch", {}, {"tag": tag}, 400),
            ]
        cases += [
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "py", "n": 0}, 400),
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "py", "n": 1001}, 400),
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "nope"}, 404),
            ("POST", "/v1/snapshots", {}, {"tag": "py"}, 409),
            ("GET", "/v1/snapshots/nope/info", {}, None, 404),
            ("DELETE", "/v1/snapshots/nope", {}, None, 404),
            ("GET", "/v1/sandboxes/sb-nope-0001", {}, None, 404),
            ("DELETE", "/v1/sandboxes/sb-nope-0001", {}, None, 404),
            ("POST", "/v1/sandboxes/sb-nope-0001/exec", {}, {"args": ["true"]}, 404),
            ("POST", "/v1/sandboxes/sb-nope-0001/branch", {}, {}, 404),
            ("POST", f"/v1/sandboxes/{box}/exec", {}, {"args": []}, 400),
            ("POST", f"/v1/sandboxes/{box}/branch", {}, {"mode": "diff"}, 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "relative/x"}, None, 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "/a\x00b"}, None, 400),
            ("PUT", f"/v1/sandboxes/{box}/files", {"path": "rel"}, b"data", 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "/no/such/file"}, None, 404),
        ]
        for method, path, params, body, want in cases:
            kw: dict[str, Any] = {"params": params}
            if isinstance(body, bytes):
                kw["content"] = body
            elif body is not None:
                kw["json"] = body
            r = c.request(method, path, **kw)
            assert r.status_code == want, (method, path, body, r.status_code, r.text)
            assert isinstance(r.json()["error"], str) and r.json()["error"]
        # Malformed JSON and oversized bodies.
        r = c.post("/v1/sandboxes", content=b'{"snapshot_tag": "py", "n": ')
        assert r.status_code == 400 and "error" in r.json()
        r = c.post(
            "/v1/snapshots", content=b'{"tag": "big", "warmup": "' + b"x" * (1 << 20) + b'"}'
        )
        assert r.status_code == 413 and "error" in r.json()

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit still holds
            yield b'{"tag": "big", "warmup": "'
            yield b"x" * (1 << 20)
            yield b'"}'

        r = c.post("/v1/snapshots", content=chunked())
        assert r.status_code == 413 and "error" in r.json()
        assert _state(daemon) == before
        assert c.delete(f"/v1/sandboxes/{box}").status_code == 204


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
        names = [e["name"] for e in c.get(
            f"/v1/sandboxes/{ids[1]}/files/list", params={"path": "/work"}).json()]  # fmt: skip
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
    assert not any(Path(f"/proc/{p}").exists() and sid.encode() in Path(
        f"/proc/{p}/cmdline").read_bytes() for p in daemon.qemu_pids())  # fmt: skip
