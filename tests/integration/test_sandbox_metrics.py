"""A real sandbox's metrics move with what its guest does: CPU burnt, memory written,
disk written, bytes sent through its port; and /metrics has its series."""

from __future__ import annotations

import time
from typing import Any

import httpx

from forkd.client import Controller, Sandbox

from .conftest import Daemon

MIB = 1 << 20
BURN = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
HOLD = "import time\nb = bytearray(80 << 20)\nb[::4096] = b'x' * len(b[::4096])\ntime.sleep(600)"


def _after(ctl: Controller, sid: str, until: Any, secs: float = 30) -> dict[str, Any]:
    """The sandbox's metrics once ``until(metrics)`` holds (the guest's page cache and
    counters settle in their own time)."""
    deadline = time.monotonic() + secs
    while True:
        m = ctl.sandbox_metrics(sid)
        if until(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def test_metrics_move_with_cpu_memory_disk_and_network(
    sb: Sandbox, ctl: Controller, daemon: Daemon
) -> None:
    before = ctl.sandbox_metrics(sb.id)
    assert before["state"] == "running" and before["cpu"]["count"] >= 1
    assert before["memory"]["guest_total_bytes"] > 200 * MIB  # a 256 MiB template
    assert before["processes"] > 1 and before["disk"]["total_bytes"] > 0

    assert sb.commands.run(f"python3 -c '{BURN}'").exit_code == 0
    burnt = ctl.sandbox_metrics(sb.id)
    assert burnt["cpu"]["seconds"] - before["cpu"]["seconds"] >= 2.0  # 3 s busy in the guest

    sb.commands.run(f'python3 -c "{HOLD}"', background=True)
    held = _after(
        ctl,
        sb.id,
        lambda m: m["memory"]["guest_used_bytes"] - before["memory"]["guest_used_bytes"] > 64 * MIB,
    )
    assert held["memory"]["guest_used_bytes"] - before["memory"]["guest_used_bytes"] > 64 * MIB
    assert held["memory"]["host_private_bytes"] - before["memory"]["host_private_bytes"] > 64 * MIB

    sb.commands.run("mkdir -p /work && dd if=/dev/urandom of=/work/blob bs=1M count=40 && sync")
    wrote = _after(
        ctl, sb.id, lambda m: m["disk"]["used_bytes"] - before["disk"]["used_bytes"] > 35 * MIB
    )
    assert wrote["disk"]["used_bytes"] - before["disk"]["used_bytes"] > 35 * MIB

    sb.commands.run("cd /work && exec python3 -m http.server 8000", background=True)
    auth = {"Authorization": f"Bearer {daemon.token}"}
    url = f"{daemon.url}/v1/sandboxes/{sb.id}/ports/8000/blob"
    deadline = time.monotonic() + 60
    while (r := httpx.get(url, headers=auth, timeout=120)).status_code != 200:
        assert time.monotonic() < deadline, "the guest's web server did not start"
        time.sleep(0.5)
    assert len(r.content) == 40 * MIB
    sent = ctl.sandbox_metrics(sb.id)
    assert sent["network"]["tx_bytes"] - before["network"]["tx_bytes"] > 40 * MIB
    assert sent["network"]["rx_bytes"] > before["network"]["rx_bytes"]

    text = httpx.get(f"{daemon.url}/metrics", headers=auth).text
    assert f'forkd_sandbox_cpu_seconds_total{{sandbox="{sb.id}"}}' in text
    listed = {m["sandbox_id"]: m for m in ctl.list_sandbox_metrics()}
    assert listed[sb.id]["memory"]["host_private_bytes"] > 64 * MIB
