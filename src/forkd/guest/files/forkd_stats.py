"""What the guest uses, for a sandbox's metrics: the ``stats`` op.

CPU time from ``/proc/stat``, memory from ``/proc/meminfo``, the root filesystem's
and each given mount point's space (``statvfs``), bytes through its network
interfaces from ``/proc/net/dev`` (loopback left out), and how many processes run.
Each read is cheap (a few small files); nothing is kept between calls: the host
works out rates. Standard library only.
"""

from __future__ import annotations

import os
from typing import Any

from forkd_agent_params import RequestError

from forkd import agent_wire as wire
from forkd.agent_wire import MAX_STATS_PATHS


def op_stats(req: dict[str, Any]) -> wire.StatsAnswer:
    paths = req.get("paths", [])
    if not isinstance(paths, list) or len(paths) > MAX_STATS_PATHS:
        raise RequestError(f"'paths' must be a list of at most {MAX_STATS_PATHS} paths")
    if not all(isinstance(p, str) and p.startswith("/") for p in paths):
        raise RequestError("'paths' must be absolute paths")
    return {
        "cpu": _cpu(),
        "memory": _memory(),
        "disk": _space("/"),
        "mounts": {p: _space(p) for p in paths},
        "network": _network(),
        "processes": sum(1 for name in os.listdir("/proc") if name.isdigit()),
        "load": list(os.getloadavg()),
    }


def _cpu() -> wire.CpuFigures:
    """Seconds the guest's CPUs spent busy and idle since it booted, and how many."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = sum(fields[3:5])  # idle, iowait
    return {
        "busy_s": (sum(fields[:8]) - idle) / hz,
        "idle_s": idle / hz,
        "count": os.cpu_count() or 1,
    }


def _memory() -> wire.Space:
    seen: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                seen[key] = int(rest.split()[0]) * 1024
    total = seen.get("MemTotal", 0)
    return {"total_bytes": total, "used_bytes": total - seen.get("MemAvailable", total)}


def _space(path: str) -> wire.Space | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    return {"total_bytes": total, "used_bytes": total - st.f_bfree * st.f_frsize}


def _network() -> wire.NetworkFigures:
    """Bytes received and sent through every interface but loopback."""
    rx = tx = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                continue
            fields = counters.split()
            rx += int(fields[0])
            tx += int(fields[8])
    return {"rx_bytes": rx, "tx_bytes": tx}


OPS = {"stats": op_stats}
