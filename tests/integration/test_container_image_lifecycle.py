"""A container image's sandbox lives like any other: paused and resumed, hibernated and
woken, with a volume (even in an image with no shell or mount of its own), and adopted
by a restarted daemon, its service still answering and its snapshot still forking."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.client import Controller
from forkd.hosttools import require_static_busybox
from tests import oci_images
from tests.integration.conftest import Daemon
from tests.integration.test_container_images import busybox_image

pytestmark = pytest.mark.integration

PAGE = ["wget", "-qO-", "http://127.0.0.1:8080/index.html"]
SERVED = "served by the image\n"


def shell_less_image() -> oci_images.Image:
    """One layer: busybox as ``cat`` and ``ls`` only (no shell, no mount, no Python)."""
    bare: dict[str, oci_images.Entry] = {
        "bin": oci_images.Dir(),
        "bin/busybox": oci_images.File(require_static_busybox().read_bytes(), 0o755),
        "bin/cat": oci_images.Symlink("busybox"),
        "bin/ls": oci_images.Symlink("busybox"),
    }
    return oci_images.image([oci_images.layer(bare)], {"Env": ["PATH=/bin"]})


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("life")
    images = {"web": busybox_image(), "bare": shell_less_image()}
    yield oci_images.write_oci_archive(d / "images.tar", images)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def web(ctl: Controller, archive: Path) -> Iterator[str]:
    info = ctl.create_snapshot(
        "bb-life", image=f"oci-archive:{archive}:web", start=True, ready_port=8080, memory_mib=256
    )
    assert info["status"] == "ready"
    yield "bb-life"
    ctl.delete_snapshot("bb-life")


def _serves(ctl: Controller, sid: str) -> None:
    page = ctl.exec_command(sid, PAGE)
    assert page["stdout"] == SERVED, page


def test_a_container_sandbox_pauses_and_hibernates_with_its_service(
    ctl: Controller, web: str
) -> None:
    (kid,) = ctl.spawn_sandboxes(web, n=1)
    sid = kid["id"]
    try:
        ctl.write_file(sid, "/srv/www/kept.txt", b"kept across hibernation\n")
        assert ctl.pause_sandbox(sid)["state"] == "paused"
        assert ctl.resume_sandbox(sid)["state"] == "running"
        _serves(ctl, sid)
        slept = ctl.pause_sandbox(sid, hibernate=True)
        assert slept["state"] == "hibernated" and slept["pid"] is None
        assert ctl.resume_sandbox(sid)["state"] == "running"
        _serves(ctl, sid)  # the service, started before the template's snapshot, runs on
        kept = ctl.exec_command(sid, ["wget", "-qO-", "http://127.0.0.1:8080/kept.txt"])
        assert kept["stdout"] == "kept across hibernation\n"
        who = ctl.exec_command(sid, ["id", "-un"])
        assert who["stdout"] == "app\n"  # the image's user, still the agent's default
    finally:
        ctl.kill_sandbox(sid)


def test_a_volume_mounts_in_an_image_without_a_shell_or_mount(
    ctl: Controller, archive: Path, tmp_path: Path
) -> None:
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "hello.txt").write_text("from the volume\n")
    ctl.create_volume("bb-vol", "64M", from_dir=str(tmp_path / "seed"))
    try:
        info = ctl.create_snapshot(
            "bb-bare",
            image=f"oci-archive:{archive}:bare",
            memory_mib=256,
            volumes=[{"name": "bb-vol", "path": "/data"}],
        )
        assert info["status"] == "ready"
        try:
            (kid,) = ctl.spawn_sandboxes("bb-bare", n=1)
            try:
                read = ctl.exec_command(kid["id"], ["cat", "/data/hello.txt"])
                assert read["stdout"] == "from the volume\n", read
                listed = ctl.exec_command(kid["id"], ["ls", "/bin"])["stdout"].split()
                assert listed == ["busybox", "cat", "ls"]  # still no shell, no mount
            finally:
                ctl.kill_sandbox(kid["id"])
        finally:
            ctl.delete_snapshot("bb-bare")
    finally:
        ctl.delete_volume("bb-vol")


@pytest.fixture
def own_daemon() -> Iterator[Daemon]:
    root = Path(tempfile.mkdtemp(prefix="forkd-cr-", dir="/tmp"))
    d = Daemon(root)
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def test_a_restarted_daemon_adopts_container_sandboxes_and_forks_their_snapshot(
    own_daemon: Daemon, archive: Path
) -> None:
    d = own_daemon
    args = ("--pool-size", "0", "--image-archive-dir", str(archive.parent))
    d.start(*args)
    with Controller(d.url, token=d.token, timeout=900) as ctl:
        ctl.create_snapshot(
            "web", image=f"oci-archive:{archive}:web", start=True, ready_port=8080, memory_mib=256
        )
        running, paused = (k["id"] for k in ctl.spawn_sandboxes("web", n=2))
        ctl.pause_sandbox(paused)
    d.stop(signal.SIGTERM)  # its sandboxes stay for the next daemon
    d.start(*args)
    with Controller(d.url, token=d.token, timeout=900) as ctl:
        assert ctl.get_sandbox(running)["state"] == "running"
        _serves(ctl, running)
        assert ctl.exec_command(running, ["id", "-un"])["stdout"] == "app\n"
        assert ctl.get_sandbox(paused)["state"] == "paused"
        assert ctl.resume_sandbox(paused)["state"] == "running"
        _serves(ctl, paused)
        (kid,) = ctl.spawn_sandboxes("web", n=1)
        _serves(ctl, kid["id"])
        for sid in (running, paused, kid["id"]):
            ctl.kill_sandbox(sid)
        ctl.delete_snapshot("web")
