"""Branch modes over the real app with a fake VM driver: full, diff and live; the
failure table in each mode, waiting or not; pending snapshots; compaction; the
delete rules of diff chains (409, cascade, force); a restart with a branch pending."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.services import disk_room
from forkd.controller.settings import Settings
from tests.unit.conftest import TOKEN
from tests.unit.fakes import FakeDriver

MODES = ["full", "diff", "live"]


def _fork(client: TestClient, tag: str) -> str:
    r = client.post("/v1/sandboxes", json={"snapshot_tag": tag})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


@pytest.fixture
def sid(client: TestClient) -> str:
    r = client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
    assert r.status_code == 201, r.text
    return _fork(client, "base")


def _branch(client: TestClient, sid: str, **body: Any) -> Any:
    return client.post(f"/v1/sandboxes/{sid}/branch", json=body)


def _settle(client: TestClient, tag: str, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get(f"/v1/snapshots/{tag}").json()
        if info["status"] != "writing" or time.monotonic() > deadline:
            return dict(info)
        time.sleep(0.02)


def _files(settings: Settings, tag: str) -> list[str]:
    d = settings.snapshot_root / tag
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _leftovers(settings: Settings) -> list[str]:
    return [p.name for p in settings.snapshot_root.iterdir() if ".partial" in p.name]


# ------------------------------------------------------------------ modes


def test_diff_branch_stores_pages_and_a_base_reference_and_chains_grow(
    client: TestClient, driver: FakeDriver, settings: Settings, sid: str
) -> None:
    r = _branch(client, sid, tag="d1", mode="diff")
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["mode"] == "diff" and info["base_tag"] == "base" and info["bootable"]
    assert info["memory"].endswith("memory.diff")
    assert _files(settings, "d1") == [
        "fake-guest.json",
        "memory.diff",
        "memory.runs",
        "snapshot.json",
        "vmstate",
    ]
    assert driver.vms[-1].events[:2] == ["begin-diff", "pause"]
    # A child of the diff, branched as a diff: depth 2, over d1.
    child = _fork(client, "d1")
    assert _branch(client, child, tag="d2", mode="diff").status_code == 201
    detail = client.get("/v1/snapshots/d2/info").json()
    assert detail["base_tag"] == "d1" and detail["diff_chain"] == ["d1", "base"]
    assert client.get("/v1/snapshots/base/info").json()["diff_dependents"] == ["d1"]
    assert client.get("/v1/snapshots/d1").json()["mode"] == "diff"
    # A full branch of the same child is independent of the chain.
    full = _branch(client, child, tag="f2").json()
    assert full["mode"] == "full" and "base_tag" not in full


def test_live_is_staged_live_and_recorded_as_full(
    client: TestClient, driver: FakeDriver, sid: str
) -> None:
    info = _branch(client, sid, tag="l1", mode="live").json()
    assert info["mode"] == "full" and info["status"] == "ready" and "pause_ms" in info
    assert driver.vms[-1].events[:2] == ["begin-live", "pause"]
    _branch(client, sid, tag="f1", mode="full")
    assert driver.vms[-1].events.count("begin") == 1  # full stays the pause-copy


def test_diff_needs_the_registered_snapshot_its_memory_maps(
    client: TestClient, driver: FakeDriver, sid: str
) -> None:
    assert client.delete("/v1/snapshots/base").status_code == 204  # children keep running
    r = _branch(client, sid, tag="d1", mode="diff")
    assert r.status_code == 409 and "mode full" in r.json()["error"]
    assert driver.vms[-1].events == []  # nothing touched
    assert _branch(client, sid, tag="f1", mode="full").status_code == 201


def test_unknown_mode_is_400_before_anything(client: TestClient, sid: str) -> None:
    r = _branch(client, sid, tag="x", mode="incremental")
    assert r.status_code == 400 and "full, diff or live" in r.json()["error"]


# ------------------------------------------------------------------ failure table


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("fail", "source_state", "kept"),
    [
        ("begin", "running", False),  # preparing fails before the pause
        ("pause", "running", False),
        ("capture", "running", False),  # snapshot write fails (disk full): source resumed
        ("capture-kill", "dead", False),  # QEMU died during the snapshot
        ("resume", "dead", True),  # resume fails after a good snapshot: branch kept
    ],
)
@pytest.mark.parametrize("wait", [True, False])
def test_failure_table_holds_in_every_mode(
    client: TestClient,
    driver: FakeDriver,
    settings: Settings,
    sid: str,
    mode: str,
    fail: str,
    source_state: str,
    kept: bool,
    wait: bool,
) -> None:
    vm = driver.vms[-1]
    vm.fail = fail
    r = _branch(client, sid, tag="b1", mode=mode, wait=wait)
    if wait:
        assert r.status_code == 500, r.text
        error = r.json()["error"]
    else:
        # Answered once the source runs again: a failure before that is already known.
        assert r.status_code == 202 and r.json()["status"] in ("writing", "failed", "ready")
        info = _settle(client, "b1")
        assert info["status"] == ("ready" if kept else "failed")
        error = info["error"]
    assert error and ("kept and valid" in error) == kept
    assert client.get(f"/v1/sandboxes/{sid}").json()["state"] == source_state
    assert not _leftovers(settings)
    if kept:
        info = client.get("/v1/snapshots/b1").json()
        assert info["bootable"] and info["mode"] == ("diff" if mode == "diff" else "full")
    elif wait:
        assert client.get("/v1/snapshots/b1").status_code == 404 and _files(settings, "b1") == []
    else:  # the failed record stays, with its error, until deleted; no files
        assert _files(settings, "b1") == []
        assert client.delete("/v1/snapshots/b1").status_code == 204
    if fail in ("pause", "begin"):
        assert "resume" not in vm.events  # never paused, or the stop did not go through


@pytest.mark.parametrize("mode", MODES)
def test_refusals_change_nothing_in_every_mode(
    client: TestClient, driver: FakeDriver, settings: Settings, sid: str, mode: str
) -> None:
    vm = driver.vms[-1]
    assert _branch(client, sid, tag="b1", mode=mode).status_code == 201
    vm.events.clear()
    assert _branch(client, sid, tag="b1", mode=mode, wait=False).status_code == 409
    assert _branch(client, "sb-none-0001", tag="b2", mode=mode).status_code == 404
    assert _branch(client, sid, tag="bad tag", mode=mode).status_code == 400
    client.app.state.services.branches.in_flight = settings.branch_concurrency  # type: ignore[attr-defined]
    assert _branch(client, sid, tag="b3", mode=mode, wait=False).status_code == 503
    client.app.state.services.branches.in_flight = 0  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as disk:  # under the 1 GiB reserve
        disk.setattr(disk_room, "free_bytes", lambda _path: 1000 << 20)
        r = _branch(client, sid, tag="b4", mode=mode, wait=False)
    assert r.status_code == 500 and "needs 1024 MiB free" in r.json()["error"], r.text
    assert vm.events == [] and client.get("/v1/snapshots/b3").status_code == 404
    assert client.get("/v1/snapshots/b4").status_code == 404 and _files(settings, "b4") == []


def test_a_template_the_disk_cannot_hold_is_refused_before_it_boots(
    client: TestClient, driver: FakeDriver, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_room, "free_bytes", lambda _path: 1000 << 20)
    r = client.post("/v1/snapshots", json={"tag": "big", "memory_mib": 1024})
    assert r.status_code == 500 and "it has 1000 MiB free" in r.json()["error"], r.text
    assert driver.vms == [] and client.get("/v1/snapshots/big").status_code == 404
    assert _files(settings, "big") == []
    settings.disk_reserve_mib = 512  # --disk-reserve 512
    r = client.post("/v1/snapshots", json={"tag": "big", "memory_mib": 1024})
    assert r.status_code == 201, r.text


# ------------------------------------------------------------------ wait false


def test_pending_cannot_be_forked_or_deleted_until_it_settles(
    client: TestClient, driver: FakeDriver, sid: str
) -> None:
    driver.vms[-1].commit_delay = 0.5
    r = _branch(client, sid, tag="p1", mode="diff", wait=False)
    assert r.status_code == 202 and r.json()["status"] == "writing" and not r.json()["bootable"]
    assert client.get("/v1/snapshots/p1/info").json()["status"] == "writing"
    fork = client.post("/v1/sandboxes", json={"snapshot_tag": "p1"})
    assert fork.status_code == 409 and "writing" in fork.json()["error"]
    assert client.delete("/v1/snapshots/p1").status_code == 409
    assert client.delete("/v1/snapshots/base?cascade=true").status_code == 409
    info = _settle(client, "p1")
    assert info["status"] == "ready" and info["bootable"] and info["mode"] == "diff"
    _fork(client, "p1")
    assert client.delete("/v1/snapshots/p1").status_code == 204


def test_a_restart_fails_pending_branches_and_removes_their_files(
    settings: Settings, tmp_path: Path
) -> None:
    driver = FakeDriver()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(settings, TOKEN, driver=driver), headers=headers) as c:
        assert c.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128}).status_code == 201
        sid = _fork(c, "base")
        driver.vms[-1].commit_delay = 30.0  # still pending when the daemon stops
        assert _branch(c, sid, tag="p1", wait=False).status_code == 202
    with TestClient(create_app(settings, TOKEN, driver=FakeDriver()), headers=headers) as c:
        info = c.get("/v1/snapshots/p1").json()
        assert info["status"] == "failed" and "daemon stopped" in info["error"]
        assert not _leftovers(settings) and _files(settings, "p1") == []
        assert c.delete("/v1/snapshots/p1").status_code == 204


# ------------------------------------------------------------------ compact and delete


@pytest.fixture
def chain(client: TestClient, sid: str) -> list[str]:
    """base <- d1 <- d2 (diffs), each with a running child."""
    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    c1 = _fork(client, "d1")
    assert _branch(client, c1, tag="d2", mode="diff").status_code == 201
    _fork(client, "d2")
    return ["base", "d1", "d2"]


def test_compact_flattens_in_place_and_dependents_stay_bootable(
    client: TestClient, settings: Settings, chain: list[str]
) -> None:
    ino = (settings.snapshot_root / "d1").stat().st_ino
    r = client.post("/v1/snapshots/d1/compact")
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == "full" and "base_tag" not in r.json()
    assert _files(settings, "d1") == ["fake-guest.json", "memory.bin", "snapshot.json", "vmstate"]
    assert (settings.snapshot_root / "d1").stat().st_ino != ino  # swapped, not rewritten
    assert not _leftovers(settings)
    d2 = client.get("/v1/snapshots/d2/info").json()
    assert d2["bootable"] and d2["diff_chain"] == ["d1"]
    _fork(client, "d2")
    _fork(client, "d1")
    # Compacting a full snapshot answers it as it is; the base is now deletable alone.
    assert client.post("/v1/snapshots/base/compact").json()["mode"] == "full"
    assert client.delete("/v1/snapshots/base").status_code == 204
    assert client.get("/v1/snapshots/d2/info").json()["bootable"]


def test_compact_to_makes_a_new_full_snapshot_and_leaves_the_source(
    client: TestClient, settings: Settings, chain: list[str]
) -> None:
    before = sorted(p.name for p in (settings.snapshot_root / "d2").iterdir())
    r = client.post("/v1/snapshots/d2/compact", json={"to": "flat"})
    assert r.status_code == 200, r.text
    flat = r.json()
    # Flat, as the original forkd's: no parent, depth 0 (the source's sandbox kept).
    assert (flat["tag"], flat["mode"], flat["parent_tag"]) == ("flat", "full", None)
    assert flat["chain_depth"] == 0 and flat["ancestors"] == []
    source = client.get("/v1/snapshots/d2").json()
    assert flat["branched_from"] == source["branched_from"]
    assert "base_tag" not in flat and flat["bootable"]
    assert _files(settings, "flat") == ["fake-guest.json", "memory.bin", "snapshot.json", "vmstate"]
    assert sorted(p.name for p in (settings.snapshot_root / "d2").iterdir()) == before
    assert client.get("/v1/snapshots/d2").json()["mode"] == "diff"
    _fork(client, "flat")
    # The new one is independent: the whole chain can go.
    assert client.delete("/v1/snapshots/base?cascade=true").status_code == 204
    assert client.get("/v1/snapshots/flat/info").json()["bootable"]
    _fork(client, "flat")
    # A full source is copied the same way.
    assert client.post("/v1/snapshots/flat/compact", json={"to": "flat2"}).status_code == 200
    assert not _leftovers(settings)


@pytest.mark.parametrize(
    ("to", "status", "named"),
    [
        ("d2", 400, "must differ"),
        ("d1", 409, "already exists"),
        ("no/pe", 400, "to"),
        ("x" * 65, 400, "to"),
    ],
)
def test_compact_to_refusals_change_nothing(
    client: TestClient, settings: Settings, chain: list[str], to: str, status: int, named: str
) -> None:
    before = client.get("/v1/snapshots").json()
    r = client.post("/v1/snapshots/d2/compact", json={"to": to})
    assert r.status_code == status, r.text
    assert named in r.json()["error"]
    assert client.get("/v1/snapshots").json() == before
    assert not _leftovers(settings)
    assert client.post("/v1/snapshots/nope/compact", json={"to": "x"}).status_code == 404


def test_delete_with_dependents_is_409_naming_them(client: TestClient, chain: list[str]) -> None:
    r = client.delete("/v1/snapshots/base")
    assert r.status_code == 409 and "d1" in r.json()["error"]
    r = client.delete("/v1/snapshots/d1")
    assert r.status_code == 409 and "d2" in r.json()["error"]
    assert client.delete("/v1/snapshots/d2").status_code == 204
    assert client.delete("/v1/snapshots/d1").status_code == 204


def test_cascade_deletes_dependents_deepest_first_and_children_keep_running(
    client: TestClient, settings: Settings, chain: list[str]
) -> None:
    assert client.delete("/v1/snapshots/base?cascade=true").status_code == 204
    assert [s["tag"] for s in client.get("/v1/snapshots").json()] == []
    running = [s for s in client.get("/v1/sandboxes").json() if s["state"] == "running"]
    assert len(running) == 3  # the forks of base, d1 and d2
    assert not [p for p in settings.snapshot_root.iterdir() if not p.name.startswith(".")]


def test_force_compacts_dependents_and_keeps_them(
    client: TestClient, settings: Settings, chain: list[str]
) -> None:
    assert client.delete("/v1/snapshots/base?force=true").status_code == 204
    d1 = client.get("/v1/snapshots/d1/info").json()
    assert d1["mode"] == "full" and d1["bootable"] and "base_tag" not in d1
    assert client.get("/v1/snapshots/d2/info").json()["diff_chain"] == ["d1"]
    _fork(client, "d2")
    r = client.delete("/v1/snapshots/d1?cascade=true&force=true")
    assert r.status_code == 400


def test_delete_query_values_are_checked(client: TestClient, chain: list[str]) -> None:
    assert client.delete("/v1/snapshots/d2?cascade=maybe").status_code in (400, 422)
    assert client.get("/v1/snapshots/d2").status_code == 200


def test_a_hibernated_sandbox_branches_as_a_diff_of_its_state_on_disk(
    client: TestClient, settings: Settings, sid: str
) -> None:
    r = client.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True})
    assert r.status_code == 200, r.text
    info = _branch(client, sid, tag="h1", mode="diff").json()
    assert info["mode"] == "diff" and info["base_tag"] == "base" and info["pause_ms"] == 0
    assert "memory.bin" not in _files(settings, "h1")
    _fork(client, "h1")
    # Woken, it maps its hibernation state, not a registered snapshot: no diff.
    assert client.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
    r = _branch(client, sid, tag="h2", mode="diff")
    assert r.status_code == 409 and "hibernation" in r.json()["error"]


# ------------------------------------------------------------------ the original forkd's forms


def test_the_original_diff_flag_is_a_diff_branch_with_its_figures(
    client: TestClient, settings: Settings, sid: str
) -> None:
    r = _branch(client, sid, tag="od", diff=True)
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["mode"] == "diff" and info["base_tag"] == "base"
    assert info["diff_logical_bytes"] == 128 << 20
    data = settings.snapshot_root / "od" / "memory.diff"
    assert info["diff_physical_bytes"] == data.stat().st_blocks * 512
    assert isinstance(info["diff_ms"], int) and info["diff_ms"] >= 0
    # A full branch says nothing of diffs.
    full = _branch(client, sid, tag="of").json()
    assert not {"diff_ms", "diff_physical_bytes", "diff_logical_bytes"} & full.keys()


def test_the_original_live_flag_is_a_live_branch(client: TestClient, sid: str) -> None:
    r = _branch(client, sid, tag="ol", live=True)
    assert r.status_code == 201, r.text
    assert r.json()["mode"] == "full"  # live is taken as full, as mode live is


def test_measure_diff_is_a_full_branch_reporting_what_a_diff_would_store(
    client: TestClient, sid: str
) -> None:
    r = _branch(client, sid, tag="om", measure_diff=True)
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["mode"] == "full" and "base_tag" not in info
    assert info["diff_logical_bytes"] == 128 << 20
    assert info["diff_physical_bytes"] % 4096 == 0
    assert 0 <= info["diff_physical_bytes"] <= info["diff_logical_bytes"]
    assert client.delete("/v1/snapshots/base?cascade=true").status_code == 204  # no dependency


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"mode": "full", "diff": True}, "not both"),
        ({"mode": "diff", "live": True}, "not both"),
        ({"diff": True, "live": True}, "at most one"),
        ({"measure_diff": True, "diff": True}, "measure_diff"),
        ({"measure_diff": True, "mode": "live"}, "measure_diff"),
        ({"diff": True, "wait": False}, "wait: false needs mode live"),
        ({"measure_diff": True, "wait": False}, "wait: false needs mode live"),
        ({"parent_tag": "base"}, "parent_tag names a diff's base"),
        ({"parent_tag": "other", "diff": True}, "is not the snapshot"),
        ({"difff": True}, "difff: unknown field"),
        ({"diff": "yes"}, "diff"),
    ],
)
def test_the_original_forms_refused_as_it_refused_them_change_nothing(
    client: TestClient, settings: Settings, sid: str, body: dict[str, Any], named: str
) -> None:
    before = client.get("/v1/snapshots").json()
    r = _branch(client, sid, tag="nope", **body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"], r.text
    assert client.get("/v1/snapshots").json() == before
    assert not (settings.snapshot_root / "nope").exists()


def test_the_original_forms_that_hold_are_served(client: TestClient, sid: str) -> None:
    # parent_tag naming the source's own snapshot, with diff: the diff is over it anyway.
    r = _branch(client, sid, tag="pt", diff=True, parent_tag="base")
    assert r.status_code == 201 and r.json()["base_tag"] == "base", r.text
    # mode with diff: false is no conflict; the live form may answer early.
    assert _branch(client, sid, tag="mf", mode="full", diff=False).status_code == 201
    r = _branch(client, sid, tag="lw", live=True, wait=False)
    assert r.status_code == 202, r.text
    assert _settle(client, "lw")["status"] == "ready"
    # Ours: mode full and diff may answer early too (documented).
    r = _branch(client, sid, tag="fw", mode="full", wait=False)
    assert r.status_code == 202, r.text
    assert _settle(client, "fw")["status"] == "ready"
