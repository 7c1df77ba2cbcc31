"""The recipes under recipes/: each demo.py runs as a real program against a real
daemon (the session's, or one of its own where the recipe needs another setting)
and must exit 0 (every check it makes passed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.guest import image as images
from tests import docker_daemon

from .conftest import Daemon

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run_recipe(daemon: Daemon, name: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, f"recipes/{name}/demo.py", *args],
        cwd=REPO,
        env={**daemon.env(), "COLUMNS": "200", **(env or {})},  # no wrapped lines
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-6000:]}"
    # A failed check prints "FAIL <name>" (a test runner's own "FAILED (...)" may be output).
    assert not [line for line in out.splitlines() if line.strip().startswith("FAIL ")], out[-6000:]
    assert f"daemon already running at {daemon.url}" in out  # used ours, started none
    return out


def _no_leftovers(daemon: Daemon, prefix: str) -> None:
    from forkd.client import Controller

    ctl = Controller(daemon.url, token=daemon.token)
    try:
        tags = [s["tag"] for s in ctl.list_snapshots()]
        sandboxes = [
            sb["id"]
            for sb in ctl.list_sandboxes()
            if (sb.get("snapshot_tag") or "").startswith(prefix)
        ]
    finally:
        ctl.close()
    assert not [t for t in tags if t.startswith(prefix)], tags
    assert not sandboxes, sandboxes  # every sandbox the demo forked is gone


def test_safe_destructive_ops(daemon: Daemon) -> None:
    out = _run_recipe(daemon, "safe-destructive-ops")
    for line in (
        "PASS the source is broken: the project is gone",
        "PASS restored files match byte-for-byte",
        "PASS work continues in the restored fork",
        "PASS work continues in the source after the delete",
        "branch pause (source frozen)",
        "all 13 checks passed",
    ):
        assert line in out, out[-6000:]
    _no_leftovers(daemon, "sdo-")


def test_ab_tools(daemon: Daemon) -> None:
    out = _run_recipe(daemon, "ab-tools")
    for line in (
        "PASS workspace has 3000 files",
        "PASS grep found",
        "PASS ripgrep found",
        "PASS both tools report the same match count",
        "winner: ",
        "all 9 checks passed",
    ):
        assert line in out, out[-6000:]
    _no_leftovers(daemon, "ab-")


def test_checkpoint_every_n(daemon: Daemon) -> None:
    out = _run_recipe(daemon, "checkpoint-every-n")
    for line in (
        "PASS agent loop ran 10 turns, checkpoints at turns [3, 6, 9]",
        "digest equals turn 6's",
        "digest equals turn 3's",
        "PASS fork of turn 6: continues with turn 7",
        "all 9 checks passed",
    ):
        assert line in out, out[-6000:]
    _no_leftovers(daemon, "ck-")


def test_best_of_n(daemon: Daemon) -> None:
    out = _run_recipe(daemon, "best-of-n", "--samples", "2")  # a cheaper data file
    for line in (
        "built cells.json: 1024 cells, 2x2 samples each",
        "unpatched suite: 12 tests: FAILED (failures=3, errors=2); 7 of 12 pass",
        "PASS the unpatched suite fails (the bugs are real)",
        "winner: 4-parse-sort-lookup.diff (12 of 12 tests pass)",
        "PASS the winner is 4-parse-sort-lookup.diff, all 12 tests passing",
        "PASS the patch that does not apply has an error and no score",
        "PASS only the winner was kept",
        "+++ b/storefinder.py",
        '+    if m.group(4).upper() == "W":',
        "PASS the winner's diff touches only the files its patch touches",
        "PASS the source is untouched: its suite still fails",
        "PASS nothing left behind",
        "all 7 checks passed",
    ):
        assert line in out, out[-6000:]
    # The ranking, best first: each patch's rank and score (or why it has none).
    for rank, patch, score in (
        (1, "4-parse-sort-lookup.diff", "12 / 12"),
        (2, "1-west-is-negative.diff", "9 / 12"),
        (3, "5-sort-by-distance.diff", "8 / 12"),
        (4, "2-flat-distance.diff", "5 / 12"),
        (5, "3-stale-parser.diff", "does not apply"),
    ):
        assert any(
            f" {rank} " in row and patch in row and score in row for row in out.splitlines()
        ), out[-6000:]
    _no_leftovers(daemon, "bn-")


@pytest.fixture(scope="module")
def dockerd() -> Iterator[docker_daemon.DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def docker_forkd(image: images.Image, dockerd: docker_daemon.DockerDaemon) -> Iterator[Daemon]:
    """A daemon of its own, importing docker-daemon: references from the tests' dockerd
    (the session's daemon reads the host's default Docker socket)."""
    root = Path(tempfile.mkdtemp(prefix="forkd-dd-", dir="/tmp"))
    d = Daemon(root)
    d.start("--kill-on-exit", "--docker-host", dockerd.host)
    yield d
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def test_dockerfile_patch_search(docker_forkd: Daemon, dockerd: docker_daemon.DockerDaemon) -> None:
    base = dockerd.base_image("forkd-test/debian:12")  # Debian 12 minbase + python3
    docker_env = {"DOCKER_HOST": dockerd.host, "DOCKER_CONFIG": str(dockerd.root / "cli-config")}
    out = _run_recipe(
        docker_forkd,
        "dockerfile-patch-search",
        "--base",
        base,
        "--tag",
        "forkd-test/patch-search:1",
        env=docker_env,
    )
    for line in (
        "built docker-daemon:forkd-test/patch-search:1",
        "unpatched suite (run in the template): 7 tests: FAILED (failures=4)",
        "PASS the unpatched suite fails (the bug is real)",
        "winner: 4-pre-releases.diff makes the suite pass (7 tests: OK)",
        "PASS exactly one patch makes the suite pass",
        "PASS a stale patch is refused, nothing changed",
        "PASS a fresh fork of the template is unpatched",
        "all 5 checks passed",
    ):
        assert line in out, out[-6000:]
    # Each candidate's verdict, as unittest gave it in its own fork.
    for patch, verdict in (
        ("1-lowercase.diff", "FAILED (failures=4)"),
        ("2-int-parts.diff", "FAILED (errors=3)"),
        ("3-stale-compare.diff", "does not apply"),
    ):
        assert any(patch in row and verdict in row for row in out.splitlines()), out[-6000:]
    _no_leftovers(docker_forkd, "ps-")
