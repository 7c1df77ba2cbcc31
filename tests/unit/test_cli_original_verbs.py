"""The original forkd's command names (snapshot-info, snapshot-compact, snapshot-diff,
bench) against the real daemon app over the fake VM driver: what each sent, what it
printed, and that it leaves nothing behind."""

from __future__ import annotations

import json

from forkd.client import Controller
from tests.unit.conftest import Invoke, RecordingTransport


def test_snapshot_info_is_snapshot_info(forkd: Invoke, py: str) -> None:
    res = forkd("snapshot-info", py, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tag"] == py


def test_snapshot_diff_runs_the_command_branches_a_diff_and_removes_the_child(
    forkd: Invoke, ctl: Controller, sent: RecordingTransport, py: str
) -> None:
    res = forkd("snapshot-diff", "--from", py, "--tag", "d1", "--exec", "echo 'one two'", "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert (info["tag"], info["mode"], info["base_tag"]) == ("d1", "diff", py)
    assert "diff_physical_bytes" in info
    execs = [r for r in sent.requests if r.url.path.endswith("/exec")]
    assert json.loads(execs[-1].content)["args"] == ["echo", "one two"]  # split, no shell
    assert ctl.list_sandboxes() == []  # the child is gone
    # A failing command: no branch, no child.
    res = forkd("snapshot-diff", "--from", py, "--tag", "d2", "--exec", "exit 3")
    assert res.exit_code == 1 and "exited 3" in res.stderr
    assert "d2" not in {s["tag"] for s in ctl.list_snapshots()}
    assert ctl.list_sandboxes() == []


def test_snapshot_compact_makes_the_new_tag(forkd: Invoke, ctl: Controller, py: str) -> None:
    res = forkd("snapshot-compact", "--from", py, "--to", "flat", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tag"] == "flat"
    assert {"py", "flat"} <= {s["tag"] for s in ctl.list_snapshots()}
    res = forkd("snapshot-compact", "--from", py, "--to", py)
    assert res.exit_code == 2 and "--to must differ" in res.output


def test_bench_times_each_step_and_cleans_up(forkd: Invoke, ctl: Controller, py: str) -> None:
    res = forkd("bench", "--n", "3")
    assert res.exit_code == 0, res.output
    for step in (
        "spawn (n=1)",
        "exec round-trip",
        "branch (diff)",
        "fanout (n=3)",
        "cleanup",
        "total",
    ):
        assert step in res.stdout, res.stdout
    assert "ms/child" in res.stdout and "pause_ms=" in res.stdout
    assert ctl.list_sandboxes() == []
    assert [s["tag"] for s in ctl.list_snapshots()] == [py]
    res = forkd("bench", "--tag", py, "--json")
    steps = [s["step"] for s in json.loads(res.stdout)["steps"]]
    assert steps == ["spawn (n=1)", "exec round-trip", "branch (diff)", "fanout (n=5)", "cleanup"]
