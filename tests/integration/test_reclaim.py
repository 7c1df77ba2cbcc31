"""Reclaim under memory pressure on real VMs: a daemon whose low watermark is above what
the host has available (pressure induced by the flags, not by filling the host)
hibernates its idle sandboxes, keeps a protected one and one whose process writes,
and wakes an evicted one on its next request (exec, the port proxy) with its state."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.controller.services import host_memory

from .conftest import Daemon

IDLE_S = 2


@pytest.fixture(scope="module")
def pressed(image: Any) -> Iterator[tuple[Daemon, httpx.Client]]:
    """A daemon that always thinks the host short of memory, with a ``py`` template."""
    root = Path(tempfile.mkdtemp(prefix="forkd-r-", dir="/tmp"))
    d = Daemon(root)
    above = host_memory.read_meminfo().total_mib * 2  # never reached: always reclaiming
    d.start(
        "--kill-on-exit",
        "--pool-size",
        "0",
        "--reclaim-low",
        str(above),
        "--reclaim-high",
        str(above),
        "--reclaim-idle",
        str(IDLE_S),
    )
    with httpx.Client(
        base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=300
    ) as client:
        r = client.post("/v1/snapshots", json={"tag": "py", "memory_mib": 256})
        assert r.status_code == 201, r.text
        yield d, client
    d.stop()
    d.kill_leftovers()
    shutil.rmtree(root, ignore_errors=True)


def _fork(c: httpx.Client, **body: Any) -> str:
    r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", **body})
    assert r.status_code == 201, r.text
    return str(r.json()[0]["id"])


def _exec(c: httpx.Client, sid: str, cmd: str) -> httpx.Response:
    return c.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["sh", "-c", cmd]})


def _state(c: httpx.Client, sid: str) -> str:
    return str(c.get(f"/v1/sandboxes/{sid}").json()["state"])


def _wait_hibernated(c: httpx.Client, sid: str, secs: float = 60) -> None:
    """Polls the list (which does not count as use) until reclaim has taken ``sid``."""
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        states = {s["id"]: s["state"] for s in c.get("/v1/sandboxes").json()}
        if states[sid] == "hibernated":
            return
        time.sleep(0.5)
    raise AssertionError(f"reclaim did not hibernate {sid} in {secs} s")


def test_idle_sandboxes_are_hibernated_and_wake_on_their_next_request(
    pressed: tuple[Daemon, httpx.Client],
) -> None:
    d, c = pressed
    idle, protected, chatty = _fork(c), _fork(c, evictable=False), _fork(c)
    assert _exec(c, idle, "echo kept > /tmp/note").status_code == 200
    r = c.post(
        f"/v1/sandboxes/{chatty}/processes",
        json={"cmd": ["sh", "-c", "while :; do echo tick; sleep 0.5; done"]},
    )
    assert r.status_code == 201, r.text
    _wait_hibernated(c, idle)
    time.sleep(IDLE_S * 2)  # long enough for either of the others to be taken too
    states = {s["id"]: s["state"] for s in c.get("/v1/sandboxes").json()}
    assert states[protected] == "running" and states[chatty] == "running"

    r = _exec(c, idle, "cat /tmp/note")  # wakes it, its files as they were
    assert r.status_code == 200 and r.json()["stdout"] == "kept\n"
    assert float(r.headers["forkd-wake-ms"]) > 0
    metrics = c.get("/metrics").text
    assert any(
        line.startswith("forkd_evictions_total ") and float(line.split()[1]) >= 1
        for line in metrics.splitlines()
    )
    audit = [json.loads(line) for line in (d.state_dir / "audit.log").read_text().splitlines()]
    evicted = [r for r in audit if r.get("event") == "evicted" and r.get("sandbox") == idle]
    assert evicted and evicted[0]["reason"] == "memory_pressure" and "available_mib" in evicted[0]


def test_a_request_to_an_evicted_sandbox_s_port_wakes_it(
    pressed: tuple[Daemon, httpx.Client],
) -> None:
    _, c = pressed
    sid = _fork(c)
    server = "echo served > /tmp/index.html && cd /tmp && exec python3 -m http.server 8000"
    r = c.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["sh", "-c", server]})
    assert r.status_code == 201, r.text
    deadline = time.monotonic() + 60
    while c.get(f"/v1/sandboxes/{sid}/ports/8000/index.html").status_code != 200:
        assert time.monotonic() < deadline, "the guest's web server did not start"
        time.sleep(0.5)
    _wait_hibernated(c, sid)
    r = c.get(f"/v1/sandboxes/{sid}/ports/8000/index.html")
    assert r.status_code == 200 and r.text == "served\n"  # its server came back with it
    assert _state(c, sid) == "running"
