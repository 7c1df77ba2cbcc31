"""The daemon's warm fork pool on real VMs: a child handed out from the pool (its QEMU
ran before the request) has its own hostname, the host's time although it waited,
and random numbers no sibling shares."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from forkd.client import Controller

from .conftest import Daemon

pytestmark = pytest.mark.integration

PROBE = (
    "hostname; date +%s.%N; python3 -c 'import random; print(random.random())'; "
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
)


def _waiting(daemon: Daemon) -> int:
    r = httpx.get(f"{daemon.url}/metrics", headers={"Authorization": f"Bearer {daemon.token}"})
    line = next(x for x in r.text.splitlines() if x.startswith("forkd_pool_waiting "))
    return int(float(line.split()[1]))


@pytest.fixture
def pool_template(ctl: Controller) -> Iterator[str]:
    """A template of its own: no fork of it came before, so its pool starts empty."""
    ctl.create_snapshot("pool-tpl", memory_mib=256, warmup="x = 41")
    yield "pool-tpl"
    ctl.delete_snapshot("pool-tpl")


def test_pooled_children_are_each_their_own(
    ctl: Controller, daemon: Daemon, pool_template: str
) -> None:
    api_template = pool_template
    others = _waiting(daemon)  # pooled for other snapshots of the suite's daemon
    first = ctl.spawn_sandboxes(api_template, n=2)  # a request for two: the pool keeps two
    deadline = time.monotonic() + 120
    while _waiting(daemon) < others + 2:
        assert time.monotonic() < deadline, "the pool did not fill"
        time.sleep(0.2)
    started_before = set(daemon.qemu_pids())
    time.sleep(3)  # the pooled guests stand still meanwhile: their clocks too
    kids = ctl.spawn_sandboxes(api_template, n=2)
    try:
        assert {k["pid"] for k in kids} <= started_before  # both came from the pool
        seen = []
        for kid in kids:
            out = ctl.exec_command(kid["id"], ["sh", "-c", PROBE])
            host, now, rand, urandom = out["stdout"].split("\n")
            assert host == kid["id"]
            assert abs(float(now) - time.time()) < 3.0  # set when it was handed out (a loaded host)
            seen.append((rand, urandom))
            assert ctl.eval_code(kid["id"], "x")["result"] == "41"  # the template's state
        assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1]
    finally:
        for s in first + kids:
            ctl.kill_sandbox(s["id"])
