"""The recipes under recipes/: each demo.py runs as a real program against the
session's daemon and must exit 0 (every check it makes passed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run_recipe(daemon: Daemon, name: str) -> str:
    proc = subprocess.run(
        [sys.executable, f"recipes/{name}/demo.py"],
        cwd=REPO, env={**daemon.env(), "COLUMNS": "200"},  # no wrapped lines
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-6000:]}"
    assert "FAIL" not in out, out[-6000:]
    assert f"daemon already running at {daemon.url}" in out  # used ours, started none
    return out


def _no_leftovers(daemon: Daemon, prefix: str) -> None:
    import forkd

    ctl = forkd.Controller(daemon.url, token=daemon.token)
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
