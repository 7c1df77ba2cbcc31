"""A container image's template travels like any snapshot: pushed from the suite's daemon
through a real registry (Debian's docker-registry on loopback) and pulled by a second
daemon that has its own image cache (another host, as far as images go), it brings its
runtime disk and its image's record; forked there, its service (started before the
snapshot) answers at once and the image's defaults hold. A second pull brings no second
copy of the image."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd.client import Controller
from forkd.oci import artifact, pull, reference
from forkd.oci.registry import Registry
from forkd.vmm.snapshot import files as snapshot_files
from tests import oci_images
from tests.integration.conftest import Daemon
from tests.integration.test_container_image_lifecycle import shell_less_image
from tests.integration.test_container_images import busybox_image
from tests.registry_server import RegistryServer

pytestmark = pytest.mark.integration

PAGE = ["wget", "-qO-", "http://127.0.0.1:8080/index.html"]


class OtherHost(Daemon):
    """A daemon with a state directory and an image cache of its own."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.cache = root / "cache"

    def _serve_env(self) -> dict[str, str]:
        return {**super()._serve_env(), "FORKD_CACHE_DIR": str(self.cache)}


@pytest.fixture(scope="module")
def registry(registry_address: str) -> Iterator[RegistryServer]:
    server = RegistryServer(address=registry_address)  # the suite's daemon lists it
    yield server
    server.stop()


@pytest.fixture(scope="module")
def other(registry: RegistryServer) -> Iterator[OtherHost]:
    root = Path(tempfile.mkdtemp(prefix="forkd-d3-", dir="/tmp"))
    d = OtherHost(root)
    d.start(
        "--kill-on-exit",
        "--pool-size",
        "0",
        "--insecure-registry",
        registry.address,
        "--show-host-paths",
    )
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def ctl2(other: OtherHost) -> Iterator[Controller]:
    with Controller(other.url, token=other.token, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def web_template(ctl: Controller, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """On the suite's daemon: the busybox image's httpd, started and ready, snapshotted."""
    archive = oci_images.write_oci_archive(
        tmp_path_factory.mktemp("xfer") / "busybox.tar", {"1": busybox_image()}
    )
    info = ctl.create_snapshot(
        "bb-xfer", image=f"oci-archive:{archive}:1", start=True, ready_port=8080, memory_mib=256
    )
    assert info["status"] == "ready"
    yield "bb-xfer"
    ctl.delete_snapshot("bb-xfer")


def test_a_container_template_pushed_here_forks_there_with_its_service_warm(
    ctl: Controller,
    ctl2: Controller,
    other: OtherHost,
    registry: RegistryServer,
    web_template: str,
) -> None:
    ref = registry.ref("forkd/bb", "web")
    pushed = ctl.push_snapshot(web_template, ref)
    with Registry(reference.parse(ref), policy=registry.policy()) as reg:
        remote = pull.open_remote(reg, "web")
    assert remote.config["format"] == 2
    runtime_pieces = remote.manifest.of_part(artifact.RUNTIME_FILE)
    assert runtime_pieces and sum(la.length for la in runtime_pieces) > 10 << 20
    print(
        f"\npushed {pushed['bytes_uploaded'] >> 20} MiB of {pushed['bytes_total'] >> 20} MiB "
        f"({pushed['layers']} layers, {pushed['seconds']} s)"
    )

    started = time.monotonic()
    info = ctl2.pull_snapshot(ref, "bb-there")
    print(f"pulled in {time.monotonic() - started:.1f} s")
    files = snapshot_files.load(Path(info["dir"]))
    images_dir = other.cache / "images"
    assert files.machine.runtime is not None
    assert files.machine.runtime.parent.parent == images_dir  # its own copy, not a's
    assert files.machine.runtime.stat().st_size == sum(la.length for la in runtime_pieces)
    (image,) = [i for i in ctl2.list_images() if i["used_by"] == ["snapshot bb-there"]]
    assert image["kind"] == "container" and image["config"]["user"] == "app"
    assert image["config"]["exposed_ports"] == ["8080/tcp"]

    (kid,) = ctl2.spawn_sandboxes("bb-there", n=1)
    try:
        sid = kid["id"]
        page = ctl2.exec_command(sid, PAGE)
        assert page["stdout"] == "served by the image\n", page  # up before the snapshot
        who = ctl2.exec_command(sid, ["/bin/sh", "-c", "id -un; pwd; echo $GREETING"])
        assert who["stdout"].splitlines() == ["app", "/srv", "hello from the image"], who
    finally:
        ctl2.kill_sandbox(kid["id"])

    # Pulled again under another name: the image pulled before is used, no second copy.
    before = sorted(p.name for p in images_dir.iterdir())
    again = ctl2.pull_snapshot(ref, "bb-again")
    assert snapshot_files.load(Path(again["dir"])).machine.runtime == files.machine.runtime
    assert sorted(p.name for p in images_dir.iterdir()) == before
    for tag in ("bb-again", "bb-there"):
        ctl2.delete_snapshot(tag)


def _pulled_bytes(d: Daemon) -> float:
    """The daemon's count of bytes fetched from registries."""
    r = httpx.get(f"{d.url}/metrics", headers={"Authorization": f"Bearer {d.token}"})
    for line in r.text.splitlines():
        if line.startswith('forkd_registry_bytes_total{direction="pull"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_second_container_image_brings_only_its_root_disk(
    ctl: Controller,
    ctl2: Controller,
    other: OtherHost,
    registry: RegistryServer,
    web_template: str,
    tmp_path: Path,
) -> None:
    """The kernel, initramfs and runtime disk are every container image's of one forkd:
    a host that pulled one image links them for the next, and fetches its root disk."""
    first_ref, second_ref = registry.ref("forkd/bb", "web"), registry.ref("forkd/bare", "v1")
    ctl.push_snapshot(web_template, first_ref)
    archive = oci_images.write_oci_archive(tmp_path / "bare.tar", {"1": shell_less_image()})
    ctl.create_snapshot("bare-xfer", image=f"oci-archive:{archive}:1", memory_mib=256)
    try:
        ctl.push_snapshot("bare-xfer", second_ref)
    finally:
        ctl.delete_snapshot("bare-xfer")
    first = snapshot_files.load(Path(ctl2.pull_snapshot(first_ref, "web-first")["dir"]))
    fetched = _pulled_bytes(other)
    started = time.monotonic()
    second = snapshot_files.load(Path(ctl2.pull_snapshot(second_ref, "bare-second")["dir"]))
    (kid,) = ctl2.spawn_sandboxes("bare-second", n=1)
    try:
        assert ctl2.exec_command(kid["id"], ["ls", "/bin"])["stdout"].split() == [
            "busybox",
            "cat",
            "ls",
        ]
    finally:
        ctl2.kill_sandbox(kid["id"])
    seconds = time.monotonic() - started
    fetched = _pulled_bytes(other) - fetched
    assert first.machine.runtime is not None and second.machine.runtime is not None
    assert second.machine.runtime.parent != first.machine.runtime.parent  # two images

    def linked(a: Path, b: Path) -> bool:
        return a.stat().st_ino == b.stat().st_ino

    # The runtime disk and the kernel are the same bytes in every container image of one
    # forkd: linked. (Each import builds its own initramfs, whose bytes differ: fetched.)
    assert linked(first.machine.runtime, second.machine.runtime)
    assert linked(first.machine.vmlinuz, second.machine.vmlinuz)
    reused = {
        p.name
        for p in (second.machine.initrd, second.machine.rootfs)
        if linked(p, first.machine.runtime.parent / p.name)
    }
    reused |= {"vmlinuz", artifact.RUNTIME_FILE}
    with Registry(reference.parse(second_ref), policy=registry.policy()) as reg:
        layers = pull.open_remote(reg, "v1").manifest.layers
    assert fetched == sum(la.size for la in layers if la.part not in reused)
    shared = sum(la.size for la in layers if la.part in reused)
    print(
        f"\nsecond image's snapshot pulled and forked in {seconds:.1f} s: fetched "
        f"{fetched / 2**20:.1f} MiB, linked {shared / 2**20:.1f} MiB"
    )
    for tag in ("bare-second", "web-first"):
        ctl2.delete_snapshot(tag)
