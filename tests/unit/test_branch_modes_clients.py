"""The SDK and the CLI of branch modes against the real app under uvicorn (fake VMs):
what they send, and that a pending branch, a compaction and the delete options work."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from forkd.client import Controller, ControllerError, Sandbox, Snapshot
from tests.unit.conftest import Invoke, RecordingTransport, Server


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def test_sdk_diff_branch_without_waiting_then_compact_and_cascade(
    ctl: Controller, sent: RecordingTransport, sid: str, server: Server
) -> None:
    server.driver.vms[-1].commit_delay = 0.3
    sb = Sandbox(sandbox_id=sid, controller=ctl)
    snap = sb.branch(tag="d1", mode="diff", wait=False)
    assert sent.body() == {"tag": "d1", "mode": "diff", "wait": False}
    assert snap.status == "writing"
    assert snap.wait(timeout=10).status == "ready" and snap.mode == "diff"
    assert snap.info["base_tag"] == "py"
    kid = snap.fork(1)[0]
    kid.branch(tag="d2", mode="diff")
    with pytest.raises(ControllerError) as exc:
        ctl.delete_snapshot("d1")
    assert exc.value.status == 409 and "d2" in str(exc.value)
    assert snap.compact()["mode"] == "full"
    assert sent.requests[-1].url.path == "/v1/snapshots/d1/compact"
    Snapshot("py", controller=ctl).delete(cascade=True)
    assert sent.requests[-1].url.params["cascade"] == "true"
    # d1 is full now: only py went; d2 (a diff over d1) stays.
    assert sorted(s["tag"] for s in ctl.list_snapshots()) == ["d1", "d2"]
    ctl.delete_snapshot("d1", force=True)
    assert sent.requests[-1].url.params["force"] == "true"
    assert [s["mode"] for s in ctl.list_snapshots()] == ["full"]


def test_cli_branch_modes_compact_and_rm(
    forkd: Invoke,
    ctl: Controller,
    sent: RecordingTransport,
    sid: str,
) -> None:
    res = forkd("branch", "--from-sandbox", sid, "--tag", "d1", "--mode", "diff", "--no-wait")
    assert res.exit_code == 0, res.output
    assert json.loads(sent.requests[-1].content) == {"tag": "d1", "mode": "diff", "wait": False}
    assert "writing" in res.stdout or "d1" in res.stdout
    assert Snapshot("d1", controller=ctl).wait(timeout=10).status == "ready"
    res = forkd("snapshot", "--from-sandbox", sid, "--tag", "d2", "--mode", "diff")
    assert res.exit_code == 0, res.output
    res = forkd("snapshot", "compact", "d2")
    assert res.exit_code == 0 and "mode full" in res.stdout, res.output
    res = forkd("snapshot", "rm", "py")
    assert res.exit_code == 1 and "d1" in res.output  # d1 is a diff over py
    res = forkd("snapshot", "rm", "--cascade", "py")
    assert res.exit_code == 0, res.output
    assert [s["tag"] for s in ctl.list_snapshots()] == ["d2"]
