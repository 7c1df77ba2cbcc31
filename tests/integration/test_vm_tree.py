"""Boot, snapshot, fork and branch real VMs: the tree every later feature stands on."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from forkd.vmm.vm import VM

from .conftest import Fleet

pytestmark = pytest.mark.integration


def test_template_answers_exec_and_eval(fleet: Fleet, template: VM) -> None:
    res = fleet.loop.run(template.guest.exec(["echo", "hi"]))
    assert res["exit_code"] == 0
    assert res["stdout"] == "hi\n"
    assert fleet.loop.run(template.guest.eval("6 * 7"))["result"] == "42"
    assert template.ready_ms is not None and template.ready_ms > 0


def test_snapshot_files_and_metadata(base_snapshot: Path, template: VM) -> None:
    meta = json.loads((base_snapshot / "snapshot.json").read_text())
    assert meta["machine"]["memory_mib"] == 256
    assert meta["machine"]["accel"] in ("tcg", "kvm")
    assert meta["image"]["name"] == "python"
    assert meta["vmstate_bytes"] == (base_snapshot / "vmstate").stat().st_size
    mem = (base_snapshot / "memory.bin").stat()
    assert mem.st_size == 256 << 20
    # Sparse: only what the guest wrote is allocated.
    assert mem.st_blocks * 512 < mem.st_size
    # No staging directories left beside it.
    assert [p.name for p in base_snapshot.parent.iterdir() if p.name.startswith(".")] == []


def test_children_inherit_state_and_are_isolated(
    fleet: Fleet, template: VM, base_snapshot: Path
) -> None:
    kids = [fleet.fork(base_snapshot) for _ in range(3)]
    for kid in kids:
        assert fleet.loop.run(kid.guest.eval("x"))["result"] == "41"
        assert fleet.loop.run(kid.guest.read_file("/work/a.txt")) == b"from the template\n"
    fleet.loop.run(kids[0].guest.write_file("/work/only-in-child-1", b"1"))
    fleet.loop.run(kids[0].guest.eval("x = 1000"))
    names_2 = [e["name"] for e in fleet.loop.run(kids[1].guest.list_dir("/work"))]
    names_t = [e["name"] for e in fleet.loop.run(template.guest.list_dir("/work"))]
    assert "only-in-child-1" not in names_2
    assert "only-in-child-1" not in names_t
    assert fleet.loop.run(kids[1].guest.eval("x"))["result"] == "41"
    assert fleet.loop.run(template.guest.eval("x"))["result"] == "41"
    # The template kept running through its snapshot.
    assert fleet.loop.run(template.guest.ping())["pong"] is True


def test_branch_a_running_child(fleet: Fleet, base_snapshot: Path) -> None:
    child = fleet.fork(base_snapshot)
    fleet.loop.run(child.guest.eval("steps = ['before']"))
    fleet.loop.run(child.guest.write_file("/work/state", b"at-branch"))
    branch = fleet.snapshot(child, "child-branch")
    # The child goes on after the branch; grandchildren must not see this.
    fleet.loop.run(child.guest.eval("steps.append('after')"))
    fleet.loop.run(child.guest.write_file("/work/state", b"after-branch"))

    grandkids = [fleet.fork(branch) for _ in range(2)]
    for g in grandkids:
        assert fleet.loop.run(g.guest.eval("steps"))["result"] == "['before']"
        assert fleet.loop.run(g.guest.read_file("/work/state")) == b"at-branch"
        assert fleet.loop.run(g.guest.eval("x"))["result"] == "41"  # from the template
    fleet.loop.run(grandkids[0].guest.eval("steps.append('g0')"))
    assert fleet.loop.run(grandkids[1].guest.eval("steps"))["result"] == "['before']"
    assert fleet.loop.run(child.guest.eval("steps"))["result"] == "['before', 'after']"
    assert fleet.loop.run(child.guest.exec(["cat", "/work/state"]))["stdout"] == "after-branch"

    meta = json.loads((branch / "snapshot.json").read_text())
    assert meta["parent_snapshot"] == str(base_snapshot)
    assert meta["source_vm"] == child.id
    assert meta["pause_ms"] > 0


def test_children_get_fresh_randomness_and_clock(fleet: Fleet, base_snapshot: Path) -> None:
    kids = [fleet.fork(base_snapshot) for _ in range(2)]
    urandom = [
        fleet.loop.run(kid.guest.exec(["python3", "-c", "import os; print(os.urandom(16).hex())"]))
        for kid in kids
    ]
    assert all(r["exit_code"] == 0 for r in urandom)
    assert urandom[0]["stdout"] != urandom[1]["stdout"]
    # The warm interpreter's random module, inherited from the template.
    rand = [
        fleet.loop.run(kid.guest.eval("import random; random.random()"))["result"] for kid in kids
    ]
    assert rand[0] != rand[1]
    # In-kernel RNG state (not only new processes): os.urandom in the warm interpreter.
    warm = [
        fleet.loop.run(kid.guest.eval("import os; os.urandom(16).hex()"))["result"] for kid in kids
    ]
    assert warm[0] != warm[1]
    for kid in kids:
        said = fleet.loop.run(kid.guest.eval("import time; time.time()"))["result"]
        assert said is not None
        guest = float(said)
        assert abs(guest - time.time()) < 2.0
        assert fleet.loop.run(kid.guest.ping())["hostname"] == kid.id


def test_eval_that_kills_the_interpreter_fails_fast(fleet: Fleet, base_snapshot: Path) -> None:
    from forkd.errors import AgentError

    kid = fleet.fork(base_snapshot)
    started = time.monotonic()
    with pytest.raises(AgentError, match="agent restarted"):
        fleet.loop.run(kid.guest.eval("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert time.monotonic() - started < 20  # not the 60 s eval timeout
    # busybox init started a new agent: the sandbox answers again (fresh interpreter).
    assert fleet.loop.run(kid.guest.ping())["pong"] is True
    assert "NameError" in (fleet.loop.run(kid.guest.eval("x"))["error"] or "")
