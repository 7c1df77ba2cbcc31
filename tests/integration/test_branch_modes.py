"""Branch modes on real VMs through the daemon: a diff holds exactly a full branch's
memory, a depth-3 chain forks with every level's memory (zeroes over data too),
compaction in place under running children, a cascading delete, and a branch
that finishes in the background."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller, ControllerError, Sandbox
from forkd.vmm.snapshot import files as snapshot_files
from tests.integration.conftest import memory_digest

pytestmark = pytest.mark.integration

# Level k: a fresh random buffer; level 2 also zeroes the first MiB of level 1's.
LEVEL = """\
import hashlib, os
blob{k} = bytearray(os.urandom(6 << 20))
{extra}
marker = {k}
"""
STATE = "(marker, [hashlib.sha256(b).hexdigest() for b in ({names})])"


def _level(sb: Sandbox, k: int, extra: str = "") -> Any:
    out = sb.eval(LEVEL.format(k=k, extra=extra))
    assert out.error is None, out.error
    return _state(sb, k)


def _state(sb: Sandbox, k: int) -> Any:
    names = ", ".join(f"blob{i}" for i in range(1, k + 1)) + ","
    out = sb.eval(STATE.format(names=names))
    assert out.error is None, out.error
    return out.result


def _fork(ctl: Controller, tag: str) -> Sandbox:
    return Sandbox(tag, controller=ctl)


def test_diff_chain_compact_and_cascade(ctl: Controller, sb: Sandbox) -> None:
    kids: list[Sandbox] = []
    try:
        want1 = _level(sb, 1)
        # Paused, the source is branched twice in the same state: full and diff.
        sb.pause()
        full = ctl.branch_sandbox(sb.id, tag="m-full1")
        d1 = ctl.branch_sandbox(sb.id, tag="m-d1", mode="diff")
        sb.resume()
        assert d1["mode"] == "diff" and d1["base_tag"] == "py" and full["mode"] == "full"
        assert memory_digest(d1) == memory_digest(full)
        d1_info = ctl.snapshot_info("m-d1")
        full_info = ctl.snapshot_info("m-full1")
        assert d1_info["memory_physical_bytes"] < full_info["memory_physical_bytes"] / 4

        c1 = _fork(ctl, "m-d1")
        kids.append(c1)
        assert _state(c1, 1) == want1
        # Level 2 zeroes a MiB of level 1's data: zero pages over data are data.
        want2 = _level(c1, 2, "blob1[: 1 << 20] = bytes(1 << 20)")
        c1.branch(tag="m-d2", mode="diff")
        c2 = _fork(ctl, "m-d2")
        kids.append(c2)
        assert _state(c2, 2) == want2
        want3 = _level(c2, 3)
        c2.branch(tag="m-d3", mode="diff")
        assert ctl.snapshot_info("m-d3")["diff_chain"] == ["m-d2", "m-d1", "py"]
        c3 = _fork(ctl, "m-d3")
        assert _state(c3, 3) == want3
        c3.kill()

        # The template has a diff over it: 409 naming it; a full branch is lineage only.
        with pytest.raises(ControllerError) as exc:
            ctl.delete_snapshot("py")
        assert exc.value.status == 409 and "m-d1" in str(exc.value)

        # Compact the middle of the chain while its child c2 runs.
        before = memory_digest(ctl.snapshot_info("m-d2"))
        assert ctl.compact_snapshot("m-d2")["mode"] == "full"
        assert memory_digest(ctl.snapshot_info("m-d2")) == before
        assert ctl.snapshot_info("m-d3")["diff_chain"] == ["m-d2"]
        assert _state(c2, 3) == want3  # its child still runs
        c3 = _fork(ctl, "m-d3")
        assert _state(c3, 3) == want3
        c3.kill()
        c2.branch(tag="m-d2b", mode="diff")  # a diff over the compacted snapshot

        # Cascade: m-d2 has diff dependents m-d3 and m-d2b.
        with pytest.raises(ControllerError) as exc:
            ctl.delete_snapshot("m-d2")
        assert exc.value.status == 409
        assert "m-d3" in str(exc.value) and "m-d2b" in str(exc.value)
        ctl.delete_snapshot("m-d2", cascade=True)
        left = {s["tag"] for s in ctl.list_snapshots()}
        assert not left & {"m-d2", "m-d3", "m-d2b"} and {"m-d1", "m-full1"} <= left
        assert _state(c2, 3) == want3  # children of deleted snapshots keep running
    finally:
        for kid in kids:
            kid.kill()
        for tag in ("m-d1", "m-full1"):
            with contextlib.suppress(ControllerError):
                ctl.delete_snapshot(tag, cascade=True)


def test_wait_false_is_pending_then_ready(ctl: Controller, sb: Sandbox) -> None:
    want = _level(sb, 1)
    snap = sb.branch(tag="m-bg", mode="diff", wait=False)
    try:
        assert snap.status == "writing"  # refusals while pending: tests/unit
        assert snap.wait(timeout=120).status == "ready"
        kid = snap.fork(1)[0]
        try:
            assert _state(kid, 1) == want
        finally:
            kid.kill()
    finally:
        snap.wait(timeout=120)
        ctl.delete_snapshot("m-bg")


# A thread rewrites a 24 MiB buffer page by page, round after round, for as long
# as `writing` holds: every page holds the round that last wrote it, so at any
# instant the rounds read, page by page, as r+1 up to some page and r after it.
WRITER = """\
import threading
buf = bytearray(24 << 20)
writing = True
def _write():
    r = 0
    while writing:
        r = (r + 1) % 256
        for off in range(0, len(buf), 4096):
            buf[off] = r
            if not writing:
                return
writer = threading.Thread(target=_write, daemon=True)
writer.start()
"""
CONSISTENT = """\
writing = False
writer.join()
rounds = bytes(buf[0::4096])
drops = [i for i in range(1, len(rounds)) if rounds[i] != rounds[i - 1]]
(len(drops) <= 1 and all((rounds[i - 1] - rounds[i]) % 256 == 1 for i in drops), rounds[0])
"""


def test_live_branch_of_a_busy_sandbox_is_one_instant(ctl: Controller, sb: Sandbox) -> None:
    """Pages written while the live copy runs are copied again in the pause: a fork
    of the branch sees the buffer as it was at one instant, never an older page
    among newer ones."""
    from forkd.vmm.snapshot import write_tracking

    out = sb.eval(WRITER)
    assert out.error is None, out.error
    kids: list[Sandbox] = []
    try:
        for i in range(2):  # the second reuses the tracker made by the first
            info = ctl.branch_sandbox(sb.id, tag=f"m-live{i}", mode="live")
            assert info["mode"] == "full" and info["pause_ms"] is not None
            meta = snapshot_files.load(Path(info["dir"])).meta
            reason = write_tracking.problem()
            assert (meta.precopied_pages > 0) == (reason is None), reason
            kid = _fork(ctl, f"m-live{i}")
            kids.append(kid)
            result = kid.eval(CONSISTENT)
            assert result.error is None, result.error
            assert (result.result or "").startswith("(True,"), result.result
        assert sb.eval("writer.is_alive()").result == "True"  # the source ran on
    finally:
        sb.eval("writing = False")
        for kid in kids:
            kid.kill()
        for i in range(2):
            with contextlib.suppress(ControllerError):
                ctl.delete_snapshot(f"m-live{i}")
