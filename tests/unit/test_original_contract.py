"""What the original forkd clients (its Controller, TypeScript SDK and MCP server)
read from this daemon, each gap they tripped on: pause_ms an integer, the two branch
gauges, has_branched, branch_count and last_branch_memory_path, warning, counts as
integers, ancestors root first, and DELETE with
?cascade=true or ?force=true."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.settings import Settings


def _fork(client: TestClient, tag: str) -> str:
    r = client.post("/v1/sandboxes", json={"snapshot_tag": tag})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


@pytest.fixture
def sid(client: TestClient) -> str:
    assert client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    return _fork(client, "py")


def _branch(client: TestClient, sid: str, **body: Any) -> dict[str, Any]:
    r = client.post(f"/v1/sandboxes/{sid}/branch", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_pause_ms_is_an_integer(client: TestClient, sid: str) -> None:
    info = _branch(client, sid, tag="b1")
    assert type(info["pause_ms"]) is int
    assert type(client.get("/v1/snapshots/b1").json()["pause_ms"]) is int
    listed = {s["tag"]: s for s in client.get("/v1/snapshots").json()}
    assert type(listed["b1"]["pause_ms"]) is int and listed["py"].get("pause_ms") is None


def test_branch_gauges(client: TestClient, settings: Settings, sid: str) -> None:
    metrics = client.get("/metrics").text
    assert "forkd_branches_in_flight 0\n" in metrics
    assert f"forkd_branch_concurrency_cap {settings.branch_concurrency}\n" in metrics


def test_has_branched_and_branch_count(client: TestClient, sid: str) -> None:
    info = client.get(f"/v1/sandboxes/{sid}").json()
    assert info["has_branched"] is False and info["branch_count"] == 0
    _branch(client, sid, tag="b1")
    _branch(client, sid)  # a default tag counts the same
    info = client.get(f"/v1/sandboxes/{sid}").json()
    assert info["has_branched"] is True and info["branch_count"] == 2
    (listed,) = [s for s in client.get("/v1/sandboxes").json() if s["id"] == sid]
    assert listed["branch_count"] == 2
    r = client.post(f"/v1/sandboxes/{sid}/branch", json={"tag": "b1"})  # taken: refused
    assert r.status_code == 409
    assert client.get(f"/v1/sandboxes/{sid}").json()["branch_count"] == 2


def test_ancestors_are_listed_root_first(client: TestClient, sid: str) -> None:
    _branch(client, sid, tag="b1")
    grandchild = _fork(client, "b1")
    _branch(client, grandchild, tag="b2")
    detail = client.get("/v1/snapshots/b2/info").json()
    assert detail["ancestors"] == ["py", "b1"] and detail["chain_depth"] == 2
    assert detail["parent_tag"] == "b1"


@pytest.mark.parametrize("how", ["cascade", "force"])
def test_delete_with_cascade_or_force(client: TestClient, sid: str, how: str) -> None:
    _branch(client, sid, tag="d1", mode="diff")  # a diff over py: py has a dependent
    assert client.delete("/v1/snapshots/py").status_code == 409
    assert client.delete(f"/v1/snapshots/py?{how}=true").status_code == 204
    tags = {s["tag"] for s in client.get("/v1/snapshots").json()}
    # cascade deletes the diff with its base; force compacts it first and keeps it.
    assert "py" not in tags and ("d1" in tags) == (how == "force")


def test_counts_print_as_integers_and_seconds_as_floats() -> None:
    from forkd.controller.metrics import integral_counts

    text = b"\n".join(
        [
            b"# TYPE forkd_snapshots_total gauge",
            b"forkd_snapshots_total 3.0",
            b'forkd_fork_seconds_bucket{le="0.025"} 2.0',
            b"forkd_fork_seconds_count 2.0",
            b"forkd_fork_seconds_sum 1.0",
            b"forkd_fork_seconds_created 1.7e+09",
            b"forkd_pool_waiting 0.5",
        ]
    )
    assert integral_counts(text).split(b"\n") == [
        b"# TYPE forkd_snapshots_total gauge",
        b"forkd_snapshots_total 3",
        b'forkd_fork_seconds_bucket{le="0.025"} 2',
        b"forkd_fork_seconds_count 2",
        b"forkd_fork_seconds_sum 1.0",
        b"forkd_fork_seconds_created 1.7e+09",
        b"forkd_pool_waiting 0.5",
    ]


def test_last_branch_memory_path_names_the_latest_branchs_memory(
    client: TestClient, sid: str
) -> None:
    assert client.get(f"/v1/sandboxes/{sid}").json()["last_branch_memory_path"] is None
    first = _branch(client, sid, tag="b1")
    assert client.get(f"/v1/sandboxes/{sid}").json()["last_branch_memory_path"] == first["memory"]
    second = _branch(client, sid, tag="b2", mode="diff")
    (listed,) = [s for s in client.get("/v1/sandboxes").json() if s["id"] == sid]
    assert listed["last_branch_memory_path"] == second["memory"]  # the diff's memory file
    assert second["memory"].endswith("memory.diff")


def test_a_snapshot_that_cannot_be_forked_says_why_in_warning(
    client: TestClient, sid: str, settings: Settings
) -> None:
    info = _branch(client, sid, tag="b1")
    assert "warning" not in info
    (settings.state_dir / info["vmstate"]).unlink()
    listed = {s["tag"]: s for s in client.get("/v1/snapshots").json()}
    assert listed["b1"]["warning"].startswith("snapshot is not bootable: ")
    assert str(settings.state_dir) not in listed["b1"]["warning"]  # no host path
    assert "vmstate" in listed["b1"]["warning"] and "warning" not in listed["py"]


def test_a_snapshots_files_are_named_without_host_paths_unless_the_operator_says(
    client: TestClient, settings: Settings
) -> None:
    """Issue 35: SnapshotInfo gave a token holder host paths (dir, vmstate, memory);
    the original forkd's names stay, their values the daemon's own."""
    assert client.post("/v1/snapshots", json={"tag": "pathy", "memory_mib": 128}).status_code == 201
    info = client.get("/v1/snapshots/pathy").json()
    assert (info["dir"], info["vmstate"]) == ("snapshots/pathy", "snapshots/pathy/vmstate")
    assert info["memory"].startswith("snapshots/pathy/")
    assert str(settings.state_dir) not in client.get("/v1/snapshots").text
    settings.show_host_paths = True  # forkd serve --show-host-paths
    shown = client.get("/v1/snapshots/pathy").json()
    assert shown["dir"] == str(settings.snapshot_root / "pathy")
    assert shown["vmstate"] == str(settings.snapshot_root / "pathy" / "vmstate")
