"""Container images as templates, on the real daemon: an image with nothing but a static
busybox (no Python, no glibc) and a program linked against musl (as Alpine's are)
imported from an OCI archive, its service started before the snapshot and running warm
in every fork, its config (Env, WorkingDir, User, Cmd) honoured, branched like any
sandbox; a second import fetches nothing; an image in use is not removed."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.client import Controller, ControllerError
from forkd.hosttools import require_static_busybox
from tests import oci_images
from tests.integration.conftest import Daemon

pytestmark = pytest.mark.integration

APPLETS = (
    "sh",
    "ls",
    "id",
    "cat",
    "echo",
    "env",
    "pwd",
    "sleep",
    "httpd",
    "wget",
    "ps",
    "mkdir",
    "mount",
    "umount",
    "grep",
    "touch",
    "rm",
    "tar",
)
CONFIG = {
    "Env": ["PATH=/bin", "GREETING=hello from the image"],
    "WorkingDir": "/srv",
    "User": "app",
    "Cmd": ["httpd", "-f", "-p", "8080", "-h", "/srv/www"],
    "ExposedPorts": {"8080/tcp": {}},
}


def busybox_image() -> oci_images.Image:
    """Two layers: busybox and its applets; then the user, the site, a file whited out."""
    busybox = require_static_busybox().read_bytes()
    base: dict[str, oci_images.Entry] = {
        "bin": oci_images.Dir(),
        "bin/busybox": oci_images.File(busybox, 0o755),
        "etc": oci_images.Dir(),
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n",
        "etc/group": b"root:x:0:\n",
        "srv": oci_images.Dir(),
        "srv/gone.txt": b"whited out by the next layer\n",
    }
    base.update({f"bin/{a}": oci_images.Symlink("busybox") for a in APPLETS})
    top: dict[str, oci_images.Entry] = {
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
        "etc/group": b"root:x:0:\napp:x:1000:\n",
        "home": oci_images.Dir(),
        "home/app": oci_images.Dir(0o755, 1000, 1000),
        "srv": oci_images.Dir(0o777),
        "srv/www": oci_images.Dir(),
        "srv/www/index.html": b"served by the image\n",
        "srv/.wh.gone.txt": b"",
    }
    layers = [oci_images.layer(base, "gzip"), oci_images.layer(top, "zstd")]
    return oci_images.image(layers, CONFIG)


MUSL_GCC = shutil.which("musl-gcc")  # ./dev.sh test installs musl-tools
NO_MUSL = "musl-gcc is missing (./dev.sh test installs musl-tools)"
MUSL_LOADER = Path("/lib/ld-musl-x86_64.so.1")  # Debian's musl: the loader is its libc
HELLO_C = b"""#include <stdio.h>
#include <stdlib.h>
int main(void) {
    const char *greeting = getenv("GREETING");
    printf("musl says: %s\\n", greeting ? greeting : "(no GREETING)");
    return 0;
}
"""


def musl_layer(work: Path) -> oci_images.Layer:
    """Alpine's layout: musl's loader (which is its libc) in /lib, and a program linked
    dynamically against it; no glibc anywhere."""
    assert MUSL_GCC is not None
    (work / "hello.c").write_bytes(HELLO_C)
    out = work / "hello-musl"
    subprocess.run([MUSL_GCC, "-O2", "-o", str(out), str(work / "hello.c")], check=True)
    return oci_images.layer(
        {
            "lib": oci_images.Dir(),
            "lib/ld-musl-x86_64.so.1": oci_images.File(MUSL_LOADER.resolve().read_bytes(), 0o755),
            "lib/libc.musl-x86_64.so.1": oci_images.Symlink("ld-musl-x86_64.so.1"),
            "bin/hello-musl": oci_images.File(out.read_bytes(), 0o755),
        }
    )


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("images")
    image = busybox_image()
    if MUSL_GCC is not None:
        layers = [*image.layers, musl_layer(d)]
        image = oci_images.image(layers, CONFIG)
    path = oci_images.write_oci_archive(d / "busybox.tar", {"1": image})
    yield path
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def busybox_template(ctl: Controller, archive: Path) -> Iterator[str]:
    info = ctl.create_snapshot(
        "bb-web", image=f"oci-archive:{archive}:1", start=True, ready_port=8080, memory_mib=256
    )
    assert info["status"] == "ready"
    yield "bb-web"
    ctl.delete_snapshot("bb-web")


def test_an_image_without_python_or_libc_serves_from_every_fork(
    ctl: Controller, busybox_template: str
) -> None:
    kids = ctl.spawn_sandboxes(busybox_template, n=2)
    try:
        for kid in kids:
            sid = kid["id"]
            page = ctl.exec_command(sid, ["wget", "-qO-", "http://127.0.0.1:8080/index.html"])
            assert page["stdout"] == "served by the image\n", page  # the service came warm
            who = ctl.exec_command(sid, ["/bin/sh", "-c", "id; pwd; echo $GREETING; echo $HOME"])
            assert who["stdout"].splitlines() == [
                "uid=1000(app) gid=1000(app) groups=1000(app)",
                "/srv",
                "hello from the image",
                "/home/app",
            ], who
            assert ctl.exec_command(sid, ["id", "-u"], user="root")["stdout"] == "0\n"
            listing = ctl.exec_command(sid, ["ls", "/srv"])["stdout"].split()
            assert "gone.txt" not in listing and "www" in listing  # the whiteout held
            procs = ctl.list_processes(sid)
            assert any(p["cmd"][:1] == ["httpd"] and p["running"] for p in procs), procs
    finally:
        for kid in kids:
            ctl.kill_sandbox(kid["id"])


@pytest.mark.skipif(
    MUSL_GCC is None, reason="musl-gcc is missing (./dev.sh test installs musl-tools)"
)
def test_a_program_linked_against_musl_runs_as_in_alpine(
    ctl: Controller, busybox_template: str
) -> None:
    """Nothing of forkd's runtime (its own loader and glibc) leaks into what the image runs."""
    (kid,) = ctl.spawn_sandboxes(busybox_template, n=1)
    sid = kid["id"]
    try:
        ran = ctl.exec_command(sid, ["hello-musl"])
        assert (ran["exit_code"], ran["stdout"]) == (0, "musl says: hello from the image\n"), ran
        as_root = ctl.exec_command(sid, ["/bin/hello-musl"], user="root")
        assert as_root["stdout"] == "musl says: hello from the image\n", as_root
        proc = ctl.start_process(sid, ["/bin/sh", "-c", "hello-musl && ls /lib"])
        text = "".join(ev.text or "" for ev in ctl.process_output(sid, proc["pid"]) if ev.data)
        assert text.split() == [
            "musl",
            "says:",
            "hello",
            "from",
            "the",
            "image",
            "ld-musl-x86_64.so.1",
            "libc.musl-x86_64.so.1",
        ], text
    finally:
        ctl.kill_sandbox(sid)


def test_a_terminal_in_an_image_without_bash_is_its_users_busybox_shell(
    ctl: Controller, busybox_template: str
) -> None:
    (kid,) = ctl.spawn_sandboxes(busybox_template, n=1)
    sid = kid["id"]
    try:
        proc = ctl.start_process(sid, ["/bin/sh"], pty=(80, 24))
        ctl.send_stdin(sid, proc["pid"], "id -un; pwd; exit 7\n")
        events = list(ctl.process_output(sid, proc["pid"]))
        text = "".join(ev.text or "" for ev in events if ev.data)
        assert "app" in text and "/srv" in text, text  # the image's user and directory
        assert events[-1].exit_code == 7
    finally:
        ctl.kill_sandbox(sid)


def test_a_fork_of_an_image_branches_and_its_files_work(
    ctl: Controller, busybox_template: str
) -> None:
    (kid,) = ctl.spawn_sandboxes(busybox_template, n=1)
    sid = kid["id"]
    try:
        ctl.write_file(sid, "/srv/www/state.txt", b"written before the branch\n")
        branch = ctl.branch_sandbox(sid, tag="bb-branch")
        (grandchild,) = ctl.spawn_sandboxes(branch["tag"], n=1)
        gid = grandchild["id"]
        try:
            page = ctl.exec_command(gid, ["wget", "-qO-", "http://127.0.0.1:8080/state.txt"])
            assert page["stdout"] == "written before the branch\n"
            assert ctl.read_file(gid, "/srv/www/state.txt") == b"written before the branch\n"
        finally:
            ctl.kill_sandbox(gid)
            ctl.delete_snapshot("bb-branch")
    finally:
        ctl.kill_sandbox(sid)


def test_a_second_import_fetches_nothing_and_an_image_in_use_stays(
    ctl: Controller, busybox_template: str, archive: Path
) -> None:
    again = ctl.import_image(f"oci-archive:{archive}:1")
    # Only the manifest is read again (as a pull asks the registry for it): no layer.
    assert again["bytes_fetched"] < 4096 and again["bytes_reused"] > 1_000_000, again
    assert again["kind"] == "container" and again["config"]["exposed_ports"] == ["8080/tcp"]
    listed = {(i["name"], i["key"]): i for i in ctl.list_images()}
    assert listed[again["name"], again["key"]]["used_by"], listed
    with pytest.raises(ControllerError) as refused:
        ctl.delete_image(again["name"])
    assert refused.value.status == 409
    assert again["name"] in {i["name"] for i in ctl.list_images()}


def test_bad_image_references_are_clear_and_leave_nothing(ctl: Controller, tmp_path: Path) -> None:
    before = json.dumps(sorted(i["name"] for i in ctl.list_images()))
    for ref, status in (
        (f"oci-archive:{tmp_path}/missing.tar", 404),
        ("docker-archive:relative/path.tar", 400),
        ("nosuchtransport:x", 400),
    ):
        with pytest.raises(ControllerError) as exc:
            ctl.create_snapshot("never", image=ref)
        assert exc.value.status in (status, 400, 404), (ref, exc.value)
    assert json.dumps(sorted(i["name"] for i in ctl.list_images())) == before
    assert "never" not in {s["tag"] for s in ctl.list_snapshots()}
