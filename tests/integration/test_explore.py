"""Explore on real VMs: one branch of a running sandbox, a child per variant running a
real command in the guest, scored by a real command, the best kept with its state,
the losers and (without kept children) the branch gone, the source running on."""

from __future__ import annotations

import pytest

from forkd.client import Controller
from forkd.client.explore import Step

pytestmark = pytest.mark.integration


def test_explore_keeps_the_best_child_with_its_state(ctl: Controller, api_template: str) -> None:
    source = ctl.spawn_sandboxes(api_template)[0]["id"]
    before = {s["tag"] for s in ctl.list_snapshots()}
    try:
        ctl.write_file(source, "/tmp/base", b"10")
        variants: list[Step] = [
            ["sh", "-c", "echo 3 > /tmp/add"],
            ["sh", "-c", "echo 25 > /tmp/add"],
            ["sh", "-c", "echo oops >&2; exit 2"],
            {"eval": "open('/tmp/add', 'w').write('7')"},
        ]
        score = ["sh", "-c", "echo scoring; echo $(( $(cat /tmp/base) + $(cat /tmp/add) ))"]
        res = ctl.explore_sandbox(source, variants, score, keep=1, seed=5, timeout_secs=120)
        assert [r.index for r in res.results] == [1, 3, 0, 2]
        assert [r.score for r in res.results] == [35.0, 17.0, 13.0, None]
        failed = res.results[-1]
        assert failed.exit_code == 2 and "oops" in (failed.error or "")
        assert res.pause_ms is not None and res.branch_kept
        best = res.results[0]
        alive = ctl.list_sandboxes(metadata={"forkd.parent": source})
        assert [s["id"] for s in alive] == [best.sandbox_id]
        assert alive[0]["seed"] == 6 and alive[0]["metadata"]["forkd.score"] == "35"
        assert ctl.read_file(str(best.sandbox_id), "/tmp/add") == b"25\n"
        assert ctl.get_sandbox(source)["state"] == "running"
        assert ctl.exec_command(source, ["cat", "/tmp/add"])["exit_code"] != 0  # untouched

        ctl.kill_sandbox(str(best.sandbox_id))
        ctl.delete_snapshot(res.branch)
        res = ctl.explore_sandbox(source, [["true"], ["false"]], keep=0)
        assert [r.error is None for r in res.results] == [True, False]
        assert not res.branch_kept
        assert ctl.list_sandboxes(metadata={"forkd.parent": source}) == []
        assert {s["tag"] for s in ctl.list_snapshots()} == before
    finally:
        for s in ctl.list_sandboxes():
            if s["id"] == source or s["metadata"].get("forkd.parent") == source:
                ctl.kill_sandbox(s["id"])
        for snap in ctl.list_snapshots():
            if snap["metadata"].get("forkd.parent") == source:
                ctl.delete_snapshot(snap["tag"])
