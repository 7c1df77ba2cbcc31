"""Fixtures that boot real QEMU VMs (TCG here, KVM where the host has it).

The image is built once (cached across runs) and one template is booted per
test session; tests fork children from its snapshot, which takes a fraction
of a second each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from forkd.client import Controller, Sandbox
from forkd.controller.services.live_vms import vm_id_prefixes
from forkd.guest import image as images
from forkd.launcher import DaemonProcess
from forkd.vmm.jail import cgroups, network
from forkd.vmm.qemu.host_processes import qemu_pids_under
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.vm import VM
from tests import egress_world
from tests.otlp_receiver import Collector, collecting
from tests.registry_server import free_address

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a background thread, so sync tests can share VMs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Fleet:
    """Boots and forks VMs, and kills every one of them at the end."""

    def __init__(self, loop: LoopThread, root: Path) -> None:
        self.loop = loop
        self.root = root
        self.run_root = root / "run"
        self.snap_root = root / "snaps"
        self.run_root.mkdir()
        self.snap_root.mkdir()
        self.vms: list[VM] = []

    def boot(self, img: images.Image, **kw: Any) -> VM:
        vm = self.loop.run(VM.boot(img, run_root=self.run_root, **kw))
        self.vms.append(vm)
        return vm

    def fork(self, snap: Path, **kw: Any) -> VM:
        vm = self.loop.run(VM.restore(snap, run_root=self.run_root, **kw))
        self.vms.append(vm)
        return vm

    def snapshot(self, vm: VM, name: str) -> Path:
        return self.loop.run(vm.snapshot(self.snap_root / name))

    def kill_all(self) -> None:
        for vm in self.vms:
            with contextlib.suppress(Exception):  # best effort at teardown
                self.loop.run(vm.kill(), timeout=30)
        self.vms.clear()


@pytest.fixture(scope="session")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def image() -> images.Image:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev.sh test installs it)")
    return images.build("python")


@pytest.fixture(scope="session")
def fleet(loop: LoopThread) -> Iterator[Fleet]:
    # Short path: unix socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="forkd-it-", dir="/tmp"))
    f = Fleet(loop, root)
    yield f
    f.kill_all()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def template(fleet: Fleet, image: images.Image) -> VM:
    """A booted 256 MiB template with ``x = 41`` and ``/work/a.txt``."""
    vm = fleet.boot(image, memory_mib=256)
    fleet.loop.run(vm.guest.eval("x = 41"))
    fleet.loop.run(vm.guest.write_file("/work/a.txt", b"from the template\n"))
    return vm


@pytest.fixture(scope="session")
def base_snapshot(fleet: Fleet, template: VM) -> Path:
    return fleet.snapshot(template, "base")


# ------------------------------------------------------------------ daemon


class Daemon(DaemonProcess):
    """A real ``forkd serve`` process on a free port, with a token file."""

    token = "test-token-0123456789"
    e2b_url = ""  # its E2B port, when it serves one

    def __init__(self, root: Path) -> None:
        self.root = root
        token_file = root / "token"
        token_file.write_text(self.token + "\n")
        super().__init__(root / "state", token_file=token_file, log=root / "daemon.log")

    def _serve_env(self) -> dict[str, str]:
        # Spans reach the suite's collector within a fifth of a second, metrics each 2 s.
        return {
            **super()._serve_env(),
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "2000",
        }

    def qemu_pids(self) -> list[int]:
        """QEMU processes whose runtime files live under this daemon's state dir."""
        return qemu_pids_under(self.state_dir / "run")

    def kill_leftovers(self) -> None:
        """After the daemon stopped: kill its QEMUs, remove their namespaces and cgroups."""
        for pid in self.qemu_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        db = self.state_dir / "forkd.db"
        if db.exists():
            with contextlib.closing(sqlite3.connect(db)) as conn:
                row = conn.execute("SELECT value FROM meta WHERE key = 'id_prefix'").fetchone()
            if row:
                time.sleep(0.2)  # let the killed QEMUs leave their namespaces and groups
                if not network.netns_problems():
                    network.remove_unused(vm_id_prefixes(row[0]), live=set())
                cgroups.detect().remove_unused(vm_id_prefixes(row[0]))


@pytest.fixture(scope="session")
def registry_address() -> str:
    """Where a test's registry listens (tests/registry_server.py): the suite's daemon
    lists it with --insecure-registry, as an operator lists a registry on loopback."""
    return free_address()


@pytest.fixture(scope="session")
def otlp() -> Iterator[Collector]:
    """The OpenTelemetry collector the suite's daemon sends its traces and metrics to
    (tests/otlp_receiver.py, on loopback): every integration test runs with them on."""
    with collecting() as collector:
        yield collector


@pytest.fixture(scope="session")
def daemon(image: images.Image, registry_address: str, otlp: Collector) -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-d-", dir="/tmp"))
    d = Daemon(root)
    # The egress tests pin their names here when they make their "internet" (the daemon
    # reads the file again when it changes).
    (root / "egress-hosts").write_text("")
    # ... and their "internet"'s certificates come from this CA, which the daemon trusts
    # upstream as an operator's private CA.
    egress_world.make_ca(root / "egress-test-ca")
    # Image archives the tests import are written under /tmp (pytest's tmp_path).
    # --show-host-paths: tests read snapshots' files where the answers say they are.
    d.e2b_url = f"http://{free_address()}"  # E2B's API and envd, for test_e2b.py
    d.start(
        "--e2b-bind",
        d.e2b_url.removeprefix("http://"),
        "--kill-on-exit",
        "--insecure-registry",
        registry_address,
        "--image-archive-dir",
        "/tmp",
        "--show-host-paths",
        "--egress-hosts",
        str(root / "egress-hosts"),
        "--egress-ca-file",
        str(root / "egress-test-ca" / "ca.pem"),
        "--otlp-endpoint",
        otlp.url,
        "--shared-volume-size-mib",  # test_e2b_volumes.py fills one
        "48",
    )
    yield d
    d.stop()
    d.kill_leftovers()  # nothing may outlive the suite
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def api_template(daemon: Daemon) -> str:
    """A 256 MiB template snapshot registered with the daemon, tag ``py``."""
    import httpx

    r = httpx.post(
        f"{daemon.url}/v1/snapshots",
        json={
            "tag": "py",
            "memory_mib": 256,
            "warmup": "import json\nx = 41",
            "setup": ["mkdir -p /work && echo ready > /work/setup.txt"],
        },
        headers={"Authorization": f"Bearer {daemon.token}"},
        timeout=300,
    )
    assert r.status_code == 201, r.text
    return "py"


@pytest.fixture
def e2b_env(daemon: Daemon, api_template: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """E2B's SDK pointed at the daemon's E2B port (its three variables); the template's
    tag."""
    monkeypatch.setenv("E2B_API_URL", daemon.e2b_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", daemon.e2b_url)
    monkeypatch.setenv("E2B_API_KEY", daemon.token)
    yield api_template


@pytest.fixture(scope="session")
def pydata_template(daemon: Daemon) -> Iterator[str]:
    """A template of the python-data image (numpy, pandas, matplotlib warm), tag
    ``pydata-eval``: one for the session (test_e2b.py's and test_eval.py's), its warmup
    is most of a minute under TCG."""
    images.build("python-data")  # cached after the first build
    with Controller(daemon.url, token=daemon.token, timeout=600) as ctl:
        started = time.monotonic()
        made = ctl.create_snapshot("pydata-eval", image="python-data")
        print(f"python-data template: {time.monotonic() - started:.1f} s")
        assert made["memory_mib"] == 512  # the recipe's template default
    yield "pydata-eval"
    with Controller(daemon.url, token=daemon.token) as ctl:
        ctl.delete_snapshot("pydata-eval", cascade=True)


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    """An SDK client of the suite's daemon (a long timeout: 100 MiB transfers)."""
    with Controller(daemon.url, token=daemon.token, timeout=300) as c:
        yield c


@pytest.fixture
def sb(ctl: Controller, api_template: str) -> Iterator[Sandbox]:
    """A fresh child of the ``py`` template, killed after the test."""
    with Sandbox(api_template, controller=ctl) as sandbox:
        yield sandbox


def memory_digest(info: dict[str, Any]) -> str:
    """sha256 of a snapshot's whole memory (SnapshotInfo with its ``dir``), every diff
    layer applied: two snapshots that hold the same guest RAM have the same digest."""
    import hashlib

    files = snapshot_files.load(Path(info["dir"]))
    digest = hashlib.sha256()
    with memory_diff.resolve(files) as chain:
        npages = chain.size // memory_diff.PAGE
        for first in range(0, npages, 2048):
            digest.update(chain.read(first, min(first + 2048, npages)))
    return digest.hexdigest()
