"""E2B's snapshots and fork through E2B's own SDK, against forkd's E2B port with fake
VMs: they are forkd's branch and fork. A snapshot is a template the SDK creates
sandboxes from; fork's children are ordinary forkd sandboxes of one branch."""

from __future__ import annotations

import e2b
import pytest

from tests.unit.conftest import Server
from tests.unit.e2b_port import forkd_client


def test_a_snapshot_is_a_branch_and_a_template(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    sbx.files.write("/work/state.txt", "before")
    snap = sbx.create_snapshot(name="checkpoint-1")
    assert (snap.snapshot_id, snap.names) == ("checkpoint-1", ["checkpoint-1"])
    sbx.files.write("/work/state.txt", "after")  # the source runs on, its own
    assert sbx.is_running()
    with forkd_client(server) as c:
        mine = c.get("/v1/snapshots/checkpoint-1/info").json()
    assert mine["branched_from"] == sbx.sandbox_id

    again = e2b.Sandbox.create("checkpoint-1")  # a snapshot is a template
    assert again.files.read("/work/state.txt") == "before"
    listed = [
        s.snapshot_id for s in e2b.Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
    ]
    assert listed == ["checkpoint-1"]
    with pytest.raises(e2b.SandboxException):  # a name forkd cannot tag with
        sbx.create_snapshot(name="not a name!")
    again.kill()
    assert e2b.Sandbox.delete_snapshot("checkpoint-1") is True
    assert e2b.Sandbox.delete_snapshot("checkpoint-1") is False  # gone
    sbx.kill()


def test_fork_makes_children_of_one_branch(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    sbx.files.write("/work/seed.txt", "shared")
    forks = sbx.fork(count=3, timeout=120)
    assert len(forks) == 3 and all(isinstance(f, e2b.Sandbox) for f in forks)
    children = [f for f in forks if isinstance(f, e2b.Sandbox)]
    assert {c.files.read("/work/seed.txt") for c in children} == {"shared"}
    with forkd_client(server) as c:
        rows = {r["id"]: r for r in c.get("/v1/sandboxes").json()}
    tags = {rows[child.sandbox_id]["snapshot_tag"] for child in children}
    assert len(tags) == 1  # one branch, forked three times
    [tag] = tags
    with forkd_client(server) as c:
        assert c.get(f"/v1/snapshots/{tag}/info").json()["branched_from"] == sbx.sandbox_id
    assert sbx.is_running()
    for child in children:
        child.kill()
    sbx.kill()


def test_templates_are_forkds_snapshots(server: Server, e2b_url: str) -> None:
    import httpx

    from tests.unit.conftest import TOKEN

    assert e2b.Template.exists("base") is True
    assert e2b.Template.exists("no-such-template") is False
    key = {"X-API-KEY": TOKEN}
    listed = httpx.get(f"{e2b_url}/templates", headers=key).json()
    assert [t["templateID"] for t in listed] == ["base"]
    assert listed[0]["memoryMB"] == 128 and listed[0]["buildStatus"] == "ready"
    one = httpx.get(f"{e2b_url}/templates/base", headers=key).json()
    assert one["templateID"] == "base" and len(one["builds"]) == 1
    assert httpx.get(f"{e2b_url}/templates/base").status_code == 401  # the API key, always
