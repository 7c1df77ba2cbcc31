"""Eval in container images, on the real daemon: a Debian image's own python3 runs every
eval, warmed up in the template and inherited warm by each fork, its RNG reseeded per
fork; an image without Python refuses eval (and a warm-up) with a 409 saying to use exec.

The images come from the tests' own Docker Engine (tests/docker_daemon.py: no
Docker Hub), imported as ``docker-daemon:`` references by a daemon started with
``--docker-host`` pointing at it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.client import Controller, ControllerError
from tests import docker_daemon
from tests.integration.conftest import Daemon

pytestmark = pytest.mark.integration

DEBIAN = "forkd-test/debian:12"  # minbase with python3
BUSYBOX = "forkd-test/busybox:1"  # busybox alone: no Python


@pytest.fixture(scope="module")
def dockerd() -> Iterator[docker_daemon.DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def image_daemon(dockerd: docker_daemon.DockerDaemon) -> Iterator[Daemon]:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed (./dev.sh test installs it)")
    dockerd.base_image(DEBIAN)
    dockerd.base_image(BUSYBOX)
    root = Path(tempfile.mkdtemp(prefix="forkd-ie-", dir="/tmp"))
    d = Daemon(root)
    d.start("--kill-on-exit", "--docker-host", dockerd.host)
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(image_daemon: Daemon) -> Iterator[Controller]:
    with Controller(image_daemon.url, token=image_daemon.token, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def debian_template(ctl: Controller) -> Iterator[str]:
    info = ctl.create_snapshot(
        "deb-eval", image=f"docker-daemon:{DEBIAN}", warmup="import json\nx = 41", memory_mib=256
    )
    assert info["status"] == "ready"
    yield "deb-eval"
    ctl.delete_snapshot("deb-eval")


@pytest.fixture
def forks(ctl: Controller, debian_template: str) -> Iterator[list[str]]:
    kids = ctl.spawn_sandboxes(debian_template, n=2)
    yield [kid["id"] for kid in kids]
    for kid in kids:
        ctl.kill_sandbox(kid["id"])


def _result(ctl: Controller, sid: str, code: str) -> str:
    answer = ctl.eval_code(sid, code)
    assert answer["error"] is None, answer
    return str(answer["result"])


def test_forks_eval_in_the_images_python_warm_from_the_template(
    ctl: Controller, forks: list[str]
) -> None:
    for sid in forks:
        started = time.monotonic()
        assert _result(ctl, sid, "x + 1") == "42"  # the warm-up's namespace, inherited
        warm_ms = (time.monotonic() - started) * 1000
        assert _result(ctl, sid, "json.dumps({'a': 1})") == repr('{"a": 1}')
        where = _result(ctl, sid, "import sys\n(sys.executable, sys.prefix)")
        executable, prefix = eval(where)  # a repr of two strings, from our own eval
        assert executable.startswith("/usr/bin/python3") and prefix == "/usr", where
        assert "/opt/forkd" not in where
        print(f"first eval in a fork (the template's worker, warm): {warm_ms:.0f} ms")


def test_sibling_forks_draw_different_random_numbers(ctl: Controller, forks: list[str]) -> None:
    draws = [_result(ctl, sid, "import random\nrandom.random()") for sid in forks]
    assert draws[0] != draws[1], draws


def test_a_fork_survives_its_worker_dying_and_times_out_like_the_agent(
    ctl: Controller, forks: list[str]
) -> None:
    sid = forks[0]
    died = ctl.eval_code(sid, "import os\nos._exit(7)")
    assert "exited during this eval (exit status 7)" in died["error"]
    assert "state (variables, imports) is gone" in died["error"]
    started = time.monotonic()
    assert "NameError" in ctl.eval_code(sid, "x")["error"]  # a fresh worker
    cold_ms = (time.monotonic() - started) * 1000
    print(f"eval that starts a fresh worker in a fork: {cold_ms:.0f} ms")
    answer = ctl.eval_code(sid, "while True: pass", timeout_s=1)
    assert answer["timed_out"] is True and "EvalTimeout" in answer["error"]
    assert _result(ctl, sid, "1 + 1") == "2"


def test_an_image_without_python_refuses_eval_and_warmup_with_409(ctl: Controller) -> None:
    with pytest.raises(ControllerError) as refused:
        ctl.create_snapshot(
            "bb-warm", image=f"docker-daemon:{BUSYBOX}", warmup="x = 1", memory_mib=256
        )
    assert refused.value.status == 409
    assert "no python3 on its PATH" in refused.value.message
    with pytest.raises(ControllerError) as missing:
        ctl.snapshot_info("bb-warm")  # nothing of the failed template was kept
    assert missing.value.status == 404

    ctl.create_snapshot("bb-eval", image=f"docker-daemon:{BUSYBOX}", memory_mib=256)
    try:
        (kid,) = ctl.spawn_sandboxes("bb-eval", n=1)
        try:
            with pytest.raises(ControllerError) as refused:
                ctl.eval_code(kid["id"], "1 + 1")
            assert refused.value.status == 409
            assert "use exec" in refused.value.message
            assert ctl.exec_command(kid["id"], ["echo", "still here"])["stdout"] == "still here\n"
        finally:
            ctl.kill_sandbox(kid["id"])
    finally:
        ctl.delete_snapshot("bb-eval")


@pytest.mark.parametrize(
    ("user", "dockerfile_tail"),
    [
        ("1234", "USER 1234\n"),  # a uid the image's /etc/passwd does not list
        ("postgres", "RUN useradd --system --no-create-home postgres\nUSER postgres\n"),
    ],
    ids=["uid-1234", "user-postgres"],
)
def test_eval_and_warmup_run_as_the_images_own_user(
    ctl: Controller,
    dockerd: docker_daemon.DockerDaemon,
    tmp_path: Path,
    user: str,
    dockerfile_tail: str,
) -> None:
    """Issue 36: /opt/forkd was drwx------ root (the daemon's umask), so an image whose
    USER is not root could not open forkd's eval worker: every eval and warm-up was a
    409 (Permission denied)."""
    (tmp_path / "Dockerfile").write_text(f"FROM {DEBIAN}\n{dockerfile_tail}")
    tag = dockerd.build(tmp_path, f"forkd-test/eval-as-{user}:1")
    snap = f"eval-as-{user}"
    ctl.create_snapshot(
        snap, image=f"docker-daemon:{tag}", warmup="import os\nx = 41", memory_mib=256
    )
    try:
        (kid,) = ctl.spawn_sandboxes(snap, n=1)
        try:
            assert _result(ctl, kid["id"], "x + 1") == "42"  # warm from the template
            uid = _result(ctl, kid["id"], "os.getuid()")
            assert uid != "0" and (user != "1234" or uid == "1234"), uid
        finally:
            ctl.kill_sandbox(kid["id"])
    finally:
        ctl.delete_snapshot(snap)
