"""What a diff snapshot is over, over the real app with a fake VM driver: the base is
one snapshot (its id), not a tag; a base being deleted takes no new diff; the
depth of a chain is capped; a hibernated sandbox's state is not discarded under a
branch copying it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.settings import Settings
from forkd.vmm.snapshot import files as snapshot_files
from tests.unit.fakes import FakeDriver


def _fork(client: TestClient, tag: str) -> str:
    r = client.post("/v1/sandboxes", json={"snapshot_tag": tag})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


def _branch(client: TestClient, sid: str, **body: Any) -> Any:
    return client.post(f"/v1/sandboxes/{sid}/branch", json=body)


def _services(client: TestClient) -> Any:
    return client.app.state.services  # type: ignore[attr-defined]


@pytest.fixture
def sid(client: TestClient) -> str:
    r = client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
    assert r.status_code == 201, r.text
    return _fork(client, "base")


def _meta(settings: Settings, tag: str) -> dict[str, Any]:
    return dict(json.loads((settings.snapshot_root / tag / "snapshot.json").read_text()))


# ------------------------------------------------------------------ identity


def test_a_diff_is_never_over_another_snapshot_of_the_same_tag(
    client: TestClient, driver: FakeDriver, settings: Settings, sid: str
) -> None:
    old_id = _meta(settings, "base")["id"]
    assert client.delete("/v1/snapshots/base").status_code == 204  # its child runs on
    assert client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128}).status_code == 201
    assert _meta(settings, "base")["id"] != old_id
    r = _branch(client, sid, tag="d1", mode="diff")
    assert r.status_code == 409 and "mode full" in r.json()["error"]
    assert driver.vms[1].events == []  # the source was never touched
    # A child of the new one is over it; the diff names its base's id.
    d1 = _branch(client, _fork(client, "base"), tag="d1", mode="diff")
    assert d1.status_code == 201, d1.text
    assert _meta(settings, "d1")["base"]["id"] == _meta(settings, "base")["id"]


def test_a_tag_diffs_are_still_recorded_over_cannot_be_made_again(
    client: TestClient, settings: Settings, sid: str
) -> None:
    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    # The base gone behind the daemon's back (a crash, a race): d1 still names it.
    _services(client).store.delete_snapshot("base")
    (settings.snapshot_root / "base").rename(settings.snapshot_root / ".base-gone")
    r = client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
    assert r.status_code == 409 and "d1" in r.json()["error"]
    r = _branch(client, sid, tag="base", mode="full")
    assert r.status_code == 409 and "d1" in r.json()["error"]


def test_the_vm_record_and_snapshots_carry_the_ids(
    client: TestClient, driver: FakeDriver, settings: Settings, sid: str
) -> None:
    base_id = _meta(settings, "base")["id"]
    assert driver.vms[1].origin_id == base_id
    assert _branch(client, sid, tag="f1", mode="full").status_code == 201
    f1 = _meta(settings, "f1")
    assert f1["parent_id"] == base_id and f1["id"] not in (None, base_id)
    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    d1 = _meta(settings, "d1")
    assert d1["base"]["id"] == base_id and d1["chain"][-1]["id"] == base_id
    assert client.post("/v1/snapshots/d1/compact").status_code == 200
    assert "mode" not in _meta(settings, "d1") and _meta(settings, "d1")["id"] == d1["id"]


def test_vm_record_round_trips_origin_id(tmp_path: Path) -> None:
    from forkd.vmm import runtime_meta
    from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths

    machine = MachineConfig(128, 1, "tcg", tmp_path / "k", tmp_path / "i", tmp_path / "r")
    rt = RuntimePaths(tmp_path)
    rec = runtime_meta.VMRecord(
        "vm-1",
        1,
        rt.qmp,
        rt.agent,
        tmp_path / "m",
        tmp_path / "s",
        machine,
        None,
        1.0,
        origin_id="abc",
    )
    runtime_meta.write(rt, rec)
    assert runtime_meta.read(rt).origin_id == "abc"
    data = json.loads(rt.meta.read_text())
    del data["origin_id"]  # a VM started by an older forkd: no id, so no diff over anything
    rt.meta.write_text(json.dumps(data))
    assert runtime_meta.read(rt).origin_id is None


def test_legacy_snapshots_get_a_stable_id_that_compaction_keeps(
    client: TestClient, settings: Settings, sid: str
) -> None:
    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    path = settings.snapshot_root / "d1" / "snapshot.json"
    data = json.loads(path.read_text())
    del data["id"]
    path.write_text(json.dumps(data))
    legacy = snapshot_files.load(settings.snapshot_root / "d1").meta.id
    assert legacy and legacy == snapshot_files.load(settings.snapshot_root / "d1").meta.id
    assert client.post("/v1/snapshots/d1/compact").status_code == 200
    assert _meta(settings, "d1")["id"] == legacy  # written down by the compaction


# ------------------------------------------------------------------ deletes


def test_no_diff_branch_over_a_base_a_delete_is_removing(
    client: TestClient, settings: Settings, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from forkd.vmm.snapshot import compact as snapshot_compact

    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    real = snapshot_compact.compact

    def slow(d: Path) -> Any:
        time.sleep(0.6)  # the delete awaits this compaction of d1
        return real(d)

    monkeypatch.setattr(snapshot_compact, "compact", slow)
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.update(d=client.delete("/v1/snapshots/base?force=true"))
    )
    t.start()
    time.sleep(0.2)
    r = _branch(client, sid, tag="d2", mode="diff")
    t.join()
    assert out["d"].status_code == 204
    assert r.status_code == 409 and "being deleted" in r.json()["error"]
    assert client.get("/v1/snapshots/d2").status_code == 404
    assert client.get("/v1/snapshots/d1").json()["mode"] == "full"
    assert _services(client).holds.held() == []  # given back


def test_a_delete_checks_again_just_before_the_files_go(
    client: TestClient, settings: Settings, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = _services(client).snapshots
    real = snaps.pool.drop
    slipped_in = contextlib.ExitStack()

    async def drop(d: Path) -> None:
        await real(d)
        slipped_in.enter_context(snaps.holds.diff_base("base"))  # a diff branch

    monkeypatch.setattr(snaps.pool, "drop", drop)
    r = client.delete("/v1/snapshots/base")
    assert r.status_code == 409 and "being written" in r.json()["error"]
    assert (settings.snapshot_root / "base" / "snapshot.json").is_file()
    assert client.get("/v1/snapshots/base").json()["status"] == "ready"
    slipped_in.close()


def test_a_restart_takes_mode_and_base_from_snapshot_json(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.controller.app import create_app
    from forkd.controller.store import Store
    from tests.unit.conftest import TOKEN

    headers = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(settings, TOKEN, driver=FakeDriver()), headers=headers) as c:
        assert c.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128}).status_code == 201
        assert _branch(c, _fork(c, "base"), tag="d1", mode="diff").status_code == 201
        # A crash between the compaction's swap and its registry update.
        real, lost = Store.update_snapshot, [True]
        monkeypatch.setattr(
            Store, "update_snapshot", lambda *a, **k: None if lost[0] else real(*a, **k)
        )
        assert c.post("/v1/snapshots/d1/compact").status_code == 200
        assert c.get("/v1/snapshots/d1").json()["mode"] == "diff"
        lost[0] = False
    with TestClient(create_app(settings, TOKEN, driver=FakeDriver()), headers=headers) as c:
        info = c.get("/v1/snapshots/d1").json()
        assert info["mode"] == "full" and "base_tag" not in info
        assert c.delete("/v1/snapshots/base").status_code == 204  # no dependent left


# ------------------------------------------------------------------ depth


def test_a_diff_deeper_than_the_cap_is_409_compact_first(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, sid: str
) -> None:
    from forkd import limits

    monkeypatch.setattr(limits, "MAX_DIFF_DEPTH", 2)
    assert _branch(client, sid, tag="d1", mode="diff").status_code == 201
    c1 = _fork(client, "d1")
    assert _branch(client, c1, tag="d2", mode="diff").status_code == 201
    c2 = _fork(client, "d2")
    r = _branch(client, c2, tag="d3", mode="diff")
    assert r.status_code == 409 and "compact 'd2' first" in r.json()["error"]
    assert _branch(client, c2, tag="f3", mode="full").status_code == 201
    assert client.post("/v1/snapshots/d2/compact").status_code == 200
    assert _branch(client, _fork(client, "d2"), tag="d3", mode="diff").status_code == 201


# ------------------------------------------------------------------ hibernated sources


def test_a_delete_waits_for_a_branch_copying_the_hibernated_state(
    client: TestClient, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from forkd.vmm.snapshot import copy as snapshot_copy

    assert client.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
    real, copying, most = snapshot_copy.copy_snapshot, [0], [0]

    def slow(*args: Any) -> Any:
        copying[0] += 1
        most[0] = max(most[0], copying[0])
        try:
            time.sleep(0.5)  # the DELETE comes in here
            return real(*args)
        finally:
            copying[0] -= 1

    monkeypatch.setattr(snapshot_copy, "copy_snapshot", slow)
    assert _branch(client, sid, tag="h1", mode="diff", wait=False).status_code == 202
    time.sleep(0.1)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(d=client.delete(f"/v1/sandboxes/{sid}")))
    t.start()
    time.sleep(0.1)
    second = _branch(client, sid, tag="h2", mode="full", wait=False)  # queued, not concurrent
    t.join()
    assert out["d"].status_code == 204
    deadline = time.monotonic() + 5
    while client.get("/v1/snapshots/h1").json()["status"] == "writing":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.get("/v1/snapshots/h1").json()["status"] == "ready"  # copied whole
    assert most[0] == 1
    if second.status_code == 202:  # its sandbox was gone when its turn came
        while client.get("/v1/snapshots/h2").json()["status"] == "writing":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.get("/v1/snapshots/h2").json()["status"] == "failed"
    assert sid not in _services(client).holds._sandbox_locks  # forgotten
    assert client.get(f"/v1/sandboxes/{sid}").status_code == 404


def test_the_writer_opens_only_the_base_its_vm_was_forked_from(
    client: TestClient, settings: Settings, sid: str, tmp_path: Path
) -> None:
    import os
    from types import SimpleNamespace

    from forkd.errors import SnapshotError
    from forkd.vmm.snapshot.files import BaseRef
    from forkd.vmm.snapshot.memory_strategy import DiffMemory
    from forkd.vmm.snapshot.writer import SnapshotWriter

    base = settings.snapshot_root / "base"
    base_id = _meta(settings, "base")["id"]

    def open_base(origin_id: str, ref_id: str) -> None:
        vm = SimpleNamespace(id="vm-x", origin=base, origin_id=origin_id)
        writer = SnapshotWriter(vm, tmp_path / "out", BaseRef("base", str(base), ref_id))
        assert isinstance(writer.memory_strategy, DiffMemory)
        mem_fd = os.open(tmp_path / "mem", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            writer.memory_strategy.open_base(mem_fd, 128 << 20)
        finally:
            writer.memory_strategy.close()
            os.close(mem_fd)

    open_base(base_id, base_id)
    with pytest.raises(SnapshotError, match="was not forked from"):
        open_base("an-older-one", base_id)
    with pytest.raises(SnapshotError, match="was replaced"):
        open_base("an-older-one", "an-older-one")  # the tag holds another one now
