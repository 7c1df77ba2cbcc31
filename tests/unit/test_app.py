"""The real daemon app over a fake VM driver: routes, auth, limits, error answers.

Everything but QEMU is real: the SQLite store, the snapshot files, the
services, the middleware, the FastAPI app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd import limits
from forkd.controller.http_errors import STATUS, status_of
from forkd.controller.settings import Settings
from forkd.errors import (
    AgentError,
    Busy,
    Conflict,
    ForkdError,
    HostToolMissing,
    Invalid,
    NotFound,
    SnapshotError,
    StorageFull,
)
from tests.unit.fakes import FakeDriver


def make_template(client: TestClient, tag: str = "py", **body: Any) -> dict[str, Any]:
    r = client.post("/v1/snapshots", json={"tag": tag, "memory_mib": 128, **body})
    assert r.status_code == 201, r.text
    return r.json()


def fork(client: TestClient, tag: str = "py", n: int = 1) -> list[dict[str, Any]]:
    r = client.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": n})
    assert r.status_code == 201, r.text
    return r.json()


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (Invalid("x"), 400),
        (NotFound("x"), 404),
        (Conflict("x"), 409),
        (Busy("x"), 503),
        (HostToolMissing("qemu-img", "qemu-utils"), 503),
        (AgentError("x", kind="OSError"), 502),
        (SnapshotError("x"), 500),
        (StorageFull("x"), 500),
        (ForkdError("x"), 500),
    ],
)
def test_status_comes_from_the_error_type(exc: ForkdError, status: int) -> None:
    assert status_of(exc) == status


def test_every_status_in_the_table_is_an_error_status() -> None:
    assert all(400 <= s < 600 for s in STATUS.values())


# ------------------------------------------------------------------ guard


ROUTES = [
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/snapshots"),
    ("POST", "/v1/snapshots"),
    ("GET", "/v1/snapshots/py/info"),
    ("DELETE", "/v1/snapshots/py"),
    ("GET", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/x"),
    ("DELETE", "/v1/sandboxes/x"),
    ("POST", "/v1/sandboxes/x/exec"),
    ("POST", "/v1/sandboxes/x/eval"),
    ("POST", "/v1/sandboxes/x/branch"),
    ("GET", "/v1/sandboxes/x/files?path=/a"),
    ("GET", "/v1/volumes"),
    ("POST", "/v1/volumes"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_but_healthz_wants_the_token(
    client: TestClient, method: str, path: str
) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = client.request(method, path, headers=headers)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json() == {"error": "missing or wrong bearer token"}


def test_healthz_needs_no_token(client: TestClient) -> None:
    r = client.get("/healthz", headers={"Authorization": ""})
    assert r.status_code == 200 and r.json() == {"ok": True}


def test_oversized_bodies_get_413_and_change_nothing(client: TestClient) -> None:
    big = b"x" * (limits.JSON_BODY_LIMIT + 1)
    r = client.post("/v1/snapshots", content=big)
    assert r.status_code == 413
    # A chunked body (no Content-Length) is counted as it arrives.
    r = client.post("/v1/snapshots", content=iter([big[:1000], big[1000:]]))
    assert r.status_code == 413
    assert client.get("/v1/snapshots").json() == []


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "invalid request"),
        (json.dumps({"tag": "a/b"}).encode(), "tag"),
        (json.dumps({"tag": "x" * 65}).encode(), "tag"),
        (json.dumps({"tag": "ok", "memory_mib": 1}).encode(), "memory_mib"),
        (json.dumps({"tag": "ok", "vcpus": 0}).encode(), "vcpus"),
    ],
)
def test_bad_snapshot_bodies_get_400(client: TestClient, body: bytes, needle: str) -> None:
    r = client.post("/v1/snapshots", content=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]
    assert client.get("/v1/snapshots").json() == []


def test_fork_count_out_of_range(client: TestClient) -> None:
    make_template(client)
    for n in (0, limits.MAX_FORK_N + 1):
        r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": n})
        assert r.status_code == 400
    assert client.get("/v1/sandboxes").json() == []


def test_unknown_ids_get_404(client: TestClient) -> None:
    assert client.get("/v1/snapshots/nope/info").status_code == 404
    assert client.delete("/v1/snapshots/nope").status_code == 404
    assert client.get("/v1/sandboxes/sb-nope").status_code == 404
    assert client.post("/v1/sandboxes/sb-nope/exec", json={"args": ["true"]}).status_code == 404
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "nope"})
    assert r.status_code == 404 and "snapshot 'nope' not found" in r.json()["error"]


def test_unknown_image_is_a_bad_request(client: TestClient) -> None:
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "nosuch"})
    assert r.status_code == 400 and "no built or local image 'nosuch'" in r.json()["error"]


# ------------------------------------------------------------------ lifecycle


def test_template_info_has_no_branch_fields(client: TestClient) -> None:
    info = make_template(client)
    assert info["tag"] == "py" and info["status"] == "ready" and info["bootable"]
    assert "branched_from" not in info and "pause_ms" not in info
    assert info["parent_tag"] is None and info["image"] == "python"
    detail = client.get("/v1/snapshots/py/info").json()
    assert detail["chain_depth"] == 0 and detail["ancestors"] == []
    assert detail["memory_logical_bytes"] == 128 << 20
    assert "problem" not in detail


def test_duplicate_tag_is_a_conflict(client: TestClient) -> None:
    make_template(client)
    r = client.post("/v1/snapshots", json={"tag": "py"})
    assert r.status_code == 409 and "already exists" in r.json()["error"]


def test_children_inherit_the_template_and_diverge(client: TestClient) -> None:
    make_template(client, warmup="x = 41")
    a, b = fork(client, n=2)
    assert a["state"] == b["state"] == "running" and a["id"] != b["id"]
    for sb in (a, b):
        r = client.post(f"/v1/sandboxes/{sb['id']}/eval", json={"code": "x + 1"})
        assert r.json() == {
            "result": "42",
            "error": None,
            "exit_code": 0,
            "stdout": "",
            "stderr": "",
            "display": [],
            "display_truncated": False,
            "timed_out": False,
        }
    client.post(f"/v1/sandboxes/{a['id']}/eval", json={"code": "x = 0"})
    r = client.post(f"/v1/sandboxes/{b['id']}/eval", json={"code": "x"})
    assert r.json()["result"] == "41"


def test_exec_answer_has_every_field(client: TestClient) -> None:
    make_template(client)
    (sb,) = fork(client)
    r = client.post(f"/v1/sandboxes/{sb['id']}/exec", json={"args": ["echo", "hi"]})
    assert r.status_code == 200
    assert set(r.json()) == {
        "stdout",
        "stderr",
        "exit_code",
        "timed_out",
        "stdout_truncated",
        "stderr_truncated",
        "duration_ms",
    }
    assert r.json()["stdout"] == "hi\n"


def test_files_round_trip_and_guest_refusals(client: TestClient) -> None:
    make_template(client)
    (sb,) = fork(client)
    base = f"/v1/sandboxes/{sb['id']}/files"
    r = client.put(base, params={"path": "/work/a.txt"}, content=b"hello")
    assert r.json() == {"path": "/work/a.txt", "size": 5}
    assert client.get(base, params={"path": "/work/a.txt"}).content == b"hello"
    listing = client.get(base + "/list", params={"path": "/work"}).json()
    assert [e["name"] for e in listing] == ["a.txt"]
    assert client.get(base, params={"path": "/work/none"}).status_code == 404
    assert client.get(base, params={"path": "relative"}).status_code == 400
    assert client.put(base, params={"path": "/proc/x"}, content=b"x").status_code == 403
    assert client.delete(base, params={"path": "/work/a.txt"}).status_code == 204
    assert client.get(base, params={"path": "/work/a.txt"}).status_code == 404


def test_a_guest_that_does_not_answer_is_a_502(client: TestClient, driver: FakeDriver) -> None:
    make_template(client)
    (sb,) = fork(client)
    driver.vms[-1].fail = "exec"
    r = client.post(f"/v1/sandboxes/{sb['id']}/exec", json={"args": ["true"]})
    assert r.status_code == 502


def test_a_dead_sandbox_is_a_conflict(client: TestClient, driver: FakeDriver) -> None:
    make_template(client)
    (sb,) = fork(client)
    driver.vms[-1].alive = False
    r = client.post(f"/v1/sandboxes/{sb['id']}/eval", json={"code": "1"})
    assert r.status_code == 409


def test_a_failed_fork_keeps_none(client: TestClient, driver: FakeDriver) -> None:
    make_template(client)
    driver.fail_restore = SnapshotError("memory.bin is corrupt")
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 3})
    assert r.status_code == 500 and "none were kept" in r.json()["error"]
    assert client.get("/v1/sandboxes").json() == []


def test_a_broken_snapshot_is_reported_and_refused(client: TestClient, settings: Settings) -> None:
    info = make_template(client)
    (settings.state_dir / info["vmstate"]).unlink()  # a path of the daemon's state
    listed = client.get("/v1/snapshots").json()[0]
    assert listed["status"] == "broken" and listed["bootable"] is False
    detail = client.get("/v1/snapshots/py/info").json()
    assert "vmstate is missing" in detail["problem"]
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "py"})
    assert r.status_code == 409 and "not bootable" in r.json()["error"]


def test_branch_then_grandchildren(client: TestClient) -> None:
    make_template(client, warmup="x = 41")
    (sb,) = fork(client)
    client.post(f"/v1/sandboxes/{sb['id']}/eval", json={"code": "x = 7"})
    r = client.post(f"/v1/sandboxes/{sb['id']}/branch")
    assert r.status_code == 201, r.text
    br = r.json()
    assert br["tag"] == f"branch-{sb['id']}-1" and br["branched_from"] == sb["id"]
    assert br["parent_tag"] == "py" and br["pause_ms"] >= 0
    (kid,) = fork(client, br["tag"])
    r = client.post(f"/v1/sandboxes/{kid['id']}/eval", json={"code": "x"})
    assert r.json()["result"] == "7"
    detail = client.get(f"/v1/snapshots/{br['tag']}/info").json()
    assert detail["ancestors"] == ["py"] and detail["sandboxes"] == [kid["id"]]
    r = client.post(f"/v1/sandboxes/{sb['id']}/branch", json={"mode": "copy-on-read"})
    assert r.status_code == 400


def test_kill_and_delete(client: TestClient, settings: Settings) -> None:
    make_template(client)
    (sb,) = fork(client)
    assert client.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204
    assert client.get(f"/v1/sandboxes/{sb['id']}").status_code == 404
    info = client.get("/v1/snapshots/py/info").json()
    assert client.delete("/v1/snapshots/py").status_code == 204
    assert not (settings.state_dir / info["dir"]).exists()
    assert client.get("/v1/snapshots").json() == []


def test_metrics_and_audit_log(client: TestClient, tmp_path: Path) -> None:
    make_template(client)
    client.get("/v1/sandboxes/nope")
    text = client.get("/metrics").text
    assert "forkd_snapshots_total 1\n" in text  # a count, as the original printed it
    lines = (tmp_path / "state" / "audit.log").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {"method": "GET", "path": "/v1/sandboxes/nope", "status": 404}.items() <= records[
        -1
    ].items()
    assert records[-1]["sandbox_id"] == "nope"
    assert all("unit-test-token" not in line for line in lines)


# ------------------------------------------------------------------ restart


def test_restart_finds_snapshots_and_drops_dead_sandboxes(
    settings: Any, driver: FakeDriver
) -> None:
    from forkd.controller.app import create_app

    headers = {"Authorization": "Bearer t"}
    with TestClient(create_app(settings, "t", driver=driver), headers=headers) as c:
        make_template(c)
        fork(c)
    # The fake driver adopts nothing: the sandbox is gone, the snapshot stays.
    with TestClient(create_app(settings, "t", driver=driver), headers=headers) as c:
        assert [s["tag"] for s in c.get("/v1/snapshots").json()] == ["py"]
        assert c.get("/v1/sandboxes").json() == []
    # A registry lost entirely: the snapshot on disk is registered again.
    (settings.state_dir / "forkd.db").unlink()
    with TestClient(create_app(settings, "t", driver=driver), headers=headers) as c:
        assert [s["tag"] for s in c.get("/v1/snapshots").json()] == ["py"]


# ------------------------------------------------------------------ volumes


def test_a_volume_in_use_is_not_deleted(client: TestClient) -> None:
    r = client.post("/v1/volumes", params={"name": "data", "size": "16M"})
    assert r.status_code == 201, r.text
    assert r.json()["used_by"] == []
    make_template(client, volumes=[{"name": "data", "path": "/data"}])
    (sb,) = fork(client)
    used_by = client.get("/v1/volumes/data").json()["used_by"]
    assert used_by == ["snapshot py", f"sandbox {sb['id']}"]
    r = client.delete("/v1/volumes/data")
    assert r.status_code == 409 and "in use by snapshot py" in r.json()["error"]
    client.delete(f"/v1/sandboxes/{sb['id']}")
    client.delete("/v1/snapshots/py")
    assert client.delete("/v1/volumes/data").status_code == 204
    assert client.get("/v1/volumes").json() == []


def test_a_bad_mount_point_leaves_no_layer(client: TestClient, settings: Any) -> None:
    client.post("/v1/volumes", params={"name": "data", "size": "16M"})
    r = client.post(
        "/v1/snapshots", json={"tag": "t", "volumes": [{"name": "data", "path": "/d/../etc"}]}
    )
    assert r.status_code == 400, r.text
    assert list((settings.state_dir / "volumes" / "data" / "layers").iterdir()) == []
    assert client.get("/v1/snapshots").json() == []


def test_content_larger_than_the_volume_is_a_bad_request(client: TestClient) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        blob = b"\1" * (20 << 20)
        info = tarfile.TarInfo("big.bin")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    r = client.post("/v1/volumes", params={"name": "small", "size": "16M"}, content=buf.getvalue())
    assert r.status_code == 400, r.text
    assert client.get("/v1/volumes").json() == []
