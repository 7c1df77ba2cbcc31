"""The main job, ./dev.sh demo (python -m forkd.demo), against the suite's daemon: a
template built, children forked (cold, then warm one at a time), one branched and its
grandchildren forked, each step printed with its time, nothing left behind."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration


def test_the_demo_forks_branches_and_says_how_long_each_step_took(daemon: Daemon) -> None:
    before = httpx.get(
        f"{daemon.url}/v1/snapshots", headers={"Authorization": f"Bearer {daemon.token}"}
    ).json()
    proc = subprocess.run(
        [sys.executable, "-m", "forkd.demo", "--children", "2", "--url", daemon.url],
        env={**daemon.env(), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"template \S+: booted, warmed .* snapshotted in [\d,]+ ms", out), out
    assert re.search(r"2 children in [\d,]+ ms wall .* median fork [\d,]+ ms", out), out
    # The best case beside the cold one, labelled as such.
    assert re.search(r"warm: 3 more forks one at a time.* median fork [\d,]+ ms \(best", out)
    assert "the cold case" in out
    assert re.search(r"branch \S+ of \S+: vCPUs frozen for [\d,]+ ms", out), out
    for strategy in ("[retry]", "[rewrite]", "[explore]"):
        assert strategy in out, out
    after = httpx.get(
        f"{daemon.url}/v1/snapshots", headers={"Authorization": f"Bearer {daemon.token}"}
    ).json()
    assert [s["tag"] for s in after] == [s["tag"] for s in before]  # cleaned up
