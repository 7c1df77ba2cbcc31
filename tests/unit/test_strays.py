"""Start-up cleanup kills only this daemon's stray QEMUs and deletes only its own paths."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from forkd.controller.metrics import Metrics
from forkd.controller.services import Services
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.vmm.jail import qemu_user
from tests.other_uid import SYSTEM_PYTHON
from tests.unit.fakes import FakeDriver


def _fake_qemu(run_dir: Path, uid: int | None = None) -> subprocess.Popen[bytes]:
    """A process named like QEMU whose QMP socket is in ``run_dir`` (running as ``uid``)."""
    ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    proc = subprocess.Popen(  # type: ignore[call-overload]
        [
            "qemu-system-x86_64",
            "-c",
            "import time; time.sleep(60)",
            "-qmp",
            f"unix:{run_dir}/qmp.sock,server=on,wait=off",
        ],
        executable=SYSTEM_PYTHON,
        cwd="/",
        **ids,
    )
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 5
    while b"qmp.sock" not in cmdline.read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return proc


def test_only_our_own_strays_are_killed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    settings = Settings(state, state / "snapshots", state / "run", pool_size=0)
    store = Store(state / "forkd.db")
    services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), FakeDriver())
    ours = settings.run_dir / f"sb-{store.id_prefix}-0009"
    theirs = settings.run_dir / "sb-0ther0-0001"  # another daemon's id, same run root
    for d in (ours, theirs):
        d.mkdir(parents=True)
    outside = tmp_path / "precious"
    outside.mkdir()
    procs = [_fake_qemu(ours), _fake_qemu(theirs), _fake_qemu(settings.run_dir / ".." / "x")]
    try:
        services.lifecycle.kill_strays()
        procs[0].wait(5)
        assert procs[0].returncode is not None  # ours: killed
        assert procs[1].poll() is None and procs[2].poll() is None  # not ours: untouched
        assert not ours.exists() and theirs.exists()
        assert outside.exists() and state.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other uids")
def test_a_stray_running_as_any_uid_of_the_range_is_ours(tmp_path: Path) -> None:
    """Whichever uid its QEMU was given, before a restart too; a uid outside it is not ours."""
    state = tmp_path / "state"
    settings = Settings(state, state / "snapshots", state / "run", pool_size=0)
    store = Store(state / "forkd.db")
    services = Services.create(settings, store, Metrics(lambda: 0, lambda: 0), FakeDriver())
    inside, outside = (settings.run_dir / f"sb-{store.id_prefix}-000{i}" for i in (1, 2))
    for d in (inside, outside):
        d.mkdir(parents=True)
    qemu_user.configure(qemu_user.UidRange(70000, 70009), tmp_path / "uids")
    procs = [_fake_qemu(inside, uid=70007), _fake_qemu(outside, uid=71000)]
    try:
        services.lifecycle.kill_strays()
        procs[0].wait(5)
        assert procs[1].poll() is None
    finally:
        qemu_user.configure(qemu_user.DEFAULT_RANGE)
        for p in procs:
            p.kill()
            p.wait()
