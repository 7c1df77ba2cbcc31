"""VM.restore: a damaged snapshot is refused before any QEMU starts; the steps' order.

The snapshot is a real directory written by the fake VM driver's snapshot
writer; ``launch.prepare_runtime`` and ``launch.spawn`` are replaced, so a
restore that got as far as starting QEMU fails here instead of booting one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from forkd.errors import SnapshotError
from forkd.vmm import vm as vm_module
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.qemu import launch
from forkd.vmm.qemu.argv import MachineConfig
from forkd.vmm.qemu.qmp import QMPChannel
from forkd.vmm.vm import VM
from tests.unit.fakes import FakeVM, GuestContents, make_image


class QemuStarted(Exception):
    pass


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The VM ids restore got as far as giving a run directory and a QEMU."""
    ids: list[str] = []

    def prepare_runtime(run_root: Path, vm_id: str) -> object:
        ids.append(vm_id)
        raise QemuStarted(vm_id)

    monkeypatch.setattr(launch, "prepare_runtime", prepare_runtime)
    monkeypatch.setattr(launch, "spawn", lambda *a, **kw: pytest.fail("QEMU started"))
    return ids


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """An intact snapshot of a 4 MiB fake VM."""
    image = make_image(tmp_path / "cache")
    machine = MachineConfig(
        4, 1, "tcg", image / "vmlinuz", image / "initrd.img", image / "rootfs.sqfs"
    )
    vm = FakeVM("tpl", machine, tmp_path / "tpl-run", GuestContents())
    return asyncio.run(vm.snapshot(tmp_path / "snap"))


def restore(snapshot: Path, run_root: Path) -> None:
    asyncio.run(VM.restore(snapshot, run_root=run_root, vm_id="child"))


def test_an_intact_snapshot_gets_as_far_as_starting_qemu(
    snapshot: Path, tmp_path: Path, started: list[str]
) -> None:
    with pytest.raises(QemuStarted):
        restore(snapshot, tmp_path / "run")
    assert started == ["child"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "memory.bin").unlink(), r"memory\.bin is missing"),
        (lambda d: os.truncate(d / "memory.bin", 1 << 20), r"memory\.bin is corrupt"),
        (lambda d: (d / "vmstate").unlink(), r"vmstate is missing"),
    ],
    ids=["missing-memory-bin", "truncated-memory-bin", "missing-vmstate"],
)
def test_a_damaged_snapshot_is_named_before_qemu_starts(
    snapshot: Path,
    tmp_path: Path,
    started: list[str],
    damage: Callable[[Path], None],
    message: str,
) -> None:
    damage(snapshot)
    with pytest.raises(SnapshotError, match=message) as info:
        restore(snapshot, tmp_path / "run")
    assert str(snapshot) in str(info.value)
    assert started == []
    assert not (tmp_path / "run").exists()


# ------------------------------------------------ the order of a restore's steps


class _Proc:
    """A QEMU that never exits (nothing is started)."""

    pid = os.getpid()
    returncode = None

    def poll(self) -> None:
        return None


class _RecordingQMP(QMPChannel):
    """QMP that logs each command; QEMU accepts the agent socket on the second look."""

    log: list[str]

    async def connect(self, raise_if_dead: object, timeout: float = 0) -> None:
        self.log.append("qmp connect")

    def send_fd(self, fd: int) -> None:
        pass

    async def execute(self, cmd: str, args: dict | None = None, timeout: float = 0) -> object:
        if cmd == "query-chardev":
            looks = sum(entry.startswith("query-chardev") for entry in self.log)
            state = "disconnected:" if looks == 0 else ""
            self.log.append(f"query-chardev {'disconnected' if state else 'connected'}")
            return [{"label": "agent", "filename": f"{state}unix:/x/agent.sock,server=on"}]
        self.log.append(cmd)
        return {
            "query-status": {"status": "paused"},
            "query-migrate": {"status": "completed"},
        }.get(cmd, {})


class _RecordingAgent(AgentClient):
    log: list[str]

    async def connect(self, timeout: float = 10.0) -> None:
        self.log.append("agent connect")

    async def call(
        self, op: str, params: object = None, wait: float = 0, payload: bytes | None = None
    ) -> dict:
        self.log.append(f"agent {op}")
        return {"rng_reseeded": True, "random_reseeded": True}


def test_qemu_has_accepted_the_agent_connection_before_the_guest_runs(
    snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore hang (docs/RUNBOOK.md): a guest that runs before QEMU accepted
    the agent connection is told the host left, and loses the 'restore' request."""
    log: list[str] = []
    monkeypatch.setattr(_RecordingQMP, "log", log, raising=False)
    monkeypatch.setattr(_RecordingAgent, "log", log, raising=False)
    monkeypatch.setattr(vm_module, "QMPChannel", _RecordingQMP)
    monkeypatch.setattr(vm_module, "AgentClient", _RecordingAgent)

    async def start_qemu(*args: object) -> launch.Launched:
        return launch.Launched(_Proc(), None, None, None)  # type: ignore[arg-type]

    monkeypatch.setattr(launch, "start_qemu", start_qemu)
    asyncio.run(VM.restore(snapshot, run_root=tmp_path / "run", vm_id="child"))
    assert log == [
        "qmp connect",
        "agent connect",  # queued before the state is loaded...
        "getfd",
        "migrate-incoming",
        "query-status",
        "query-migrate",
        "query-chardev disconnected",
        "query-chardev connected",  # ...and accepted by QEMU
        "cont",  # before the guest runs
        "agent restore",
    ]
