"""The Python SDK and the CLI against a real daemon with real VMs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import forkd
from forkd.client import Controller, ControllerError, Snapshot

from .conftest import Daemon

pytestmark = pytest.mark.integration


def test_sdk_lifecycle(daemon: Daemon) -> None:
    # What ``import forkd`` names (typed by mypy as object: used through forkd.client).
    assert forkd.Controller is Controller and forkd.Snapshot is Snapshot
    assert forkd.ControllerError is ControllerError
    ctl = Controller(daemon.url, token=daemon.token)
    snap = Snapshot.create(
        "sdk-tpl", controller=ctl, memory_mib=256, warmup="import json\nbase = 'warm'"
    )
    assert snap.tag == "sdk-tpl" and snap.branched_from is None
    kids = snap.fork(3)
    try:
        assert len({k.id for k in kids}) == 3
        for i, k in enumerate(kids):
            assert k.ping()["pong"] is True
            res = k.commands.run("echo $((20 + 22))")
            assert (res.stdout, res.exit_code) == ("42\n", 0)
            assert k.eval("base").result == "'warm'"
            k.files.write(f"/work/only-{i}", f"child {i}")
        for i, k in enumerate(kids):
            names = {e["name"] for e in k.files.list("/work")}
            assert f"only-{i}" in names
            assert names.isdisjoint({f"only-{j}" for j in range(3) if j != i})
            assert k.files.read_text(f"/work/only-{i}") == f"child {i}"
        kids[0].files.remove("/work/only-0")
        assert "only-0" not in {e["name"] for e in kids[0].files.list("/work")}
        failing = kids[1].commands.run(["sh", "-c", "echo oops >&2; exit 3"])
        assert (failing.exit_code, failing.stderr) == (3, "oops\n")
        error = kids[1].eval("1/0").error
        assert error and "ZeroDivisionError" in error

        kids[0].eval("step = 'branched'")
        branch = kids[0].branch()
        assert branch.branched_from == kids[0].id and branch.pause_ms is not None
        (grandkid,) = branch.fork(1)
        with grandkid:
            assert grandkid.eval("step").result == "'branched'"
        assert grandkid.killed
    finally:
        for k in kids:
            k.kill()
    with pytest.raises(ControllerError) as exc:
        ctl.get_sandbox(kids[0].id)
    assert exc.value.status == 404
    branch.delete()
    snap.delete()
    assert "sdk-tpl" not in {s["tag"] for s in ctl.list_snapshots()}


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "forkd.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=daemon.env(),
    )


def test_cli_happy_path(daemon: Daemon) -> None:
    r = _cli(
        daemon,
        "snapshot",
        "create",
        "--tag",
        "cli-tpl",
        "--memory",
        "256",
        "--setup",
        "echo from-setup > /work/s.txt",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tag"] == "cli-tpl"

    r = _cli(daemon, "fork", "--tag", "cli-tpl", "-n", "2", "--json")
    assert r.returncode == 0, r.stderr
    ids = [s["id"] for s in json.loads(r.stdout)]
    assert len(ids) == 2

    r = _cli(daemon, "exec", ids[0], "--", "cat", "/work/s.txt")
    assert (r.returncode, r.stdout) == (0, "from-setup\n"), r.stderr
    r = _cli(daemon, "exec", ids[0], "--", "sh", "-c", "exit 7")
    assert r.returncode == 7

    r = _cli(daemon, "snapshot", "--from-sandbox", ids[0], "--tag", "cli-branch")
    assert r.returncode == 0, r.stderr
    assert "cli-branch" in r.stdout and "ms" in r.stdout

    r = _cli(daemon, "ps", "--json")
    assert {s["id"] for s in json.loads(r.stdout)} >= set(ids)

    r = _cli(daemon, "rm", *ids)
    assert r.returncode == 0, r.stderr
    r = _cli(daemon, "exec", ids[0], "--", "true")
    assert r.returncode != 0 and "not found" in r.stderr

    r = _cli(daemon, "rmi", "cli-branch", "cli-tpl")
    assert r.returncode == 0, r.stderr
    r = _cli(daemon, "snapshot", "info", "cli-tpl")
    assert r.returncode == 1 and "not found" in r.stderr


def test_cli_volumes(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "hello.txt").write_text("hi from the host\n")
    r = _cli(daemon, "volume", "create", "cli-vol", "--size", "64M", "--from", str(tmp_path))
    assert r.returncode == 0, r.stderr
    r = _cli(
        daemon,
        "snapshot",
        "create",
        "--tag",
        "cli-vol-tpl",
        "--memory",
        "256",
        "--volume",
        "cli-vol:/mnt/in:ro",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    r = _cli(daemon, "fork", "--tag", "cli-vol-tpl", "--json")
    (sid,) = [s["id"] for s in json.loads(r.stdout)]
    r = _cli(daemon, "exec", sid, "--", "cat", "/mnt/in/docs/hello.txt")
    assert (r.returncode, r.stdout) == (0, "hi from the host\n"), r.stderr
    r = _cli(daemon, "volume", "rm", "cli-vol")
    assert r.returncode == 1 and "in use" in r.stderr
    r = _cli(daemon, "volume", "ls", "--json")
    assert any(v["name"] == "cli-vol" for v in json.loads(r.stdout))
    assert _cli(daemon, "rm", sid).returncode == 0
    assert _cli(daemon, "rmi", "cli-vol-tpl").returncode == 0
    r = _cli(daemon, "volume", "rm", "cli-vol")
    assert r.returncode == 0, r.stderr
