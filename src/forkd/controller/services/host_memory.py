"""What this host's memory really holds, for admission: what the host has available,
and what each sandbox's QEMU holds of its own.

Forks share their snapshot's pages: an idle child of a 256 MiB template holds
about 27 MiB of its own, 40 once it ran a command (docs/RUNBOOK.md, "Sizing a
host"). Counting every guest at its nominal size refuses forks long before the
host is full; counting only what the host has available now admits a burst whose
VMs have not touched their memory yet. So admission
(:class:`~forkd.controller.services.admission.AdmissionControl`) weighs:

- the host's ``MemAvailable`` (free memory plus the page cache the kernel can
  drop, the snapshots' pages included), read fresh each time, or what the memory
  limit of the cgroup the VMs are charged to leaves, when that is less (a daemon
  in a container: :mod:`forkd.vmm.jail.memory_limit`);
- a reserve kept for the host, the daemon and the hot pages of snapshots;
- what sandboxes being started, or started less than :data:`SETTLE_SECS` ago,
  will take and do not hold yet: each at its fork estimate, the median of what its
  settled siblings (children of the same snapshot) hold of their own, and
  :data:`~forkd.limits.FORK_ESTIMATE_MIB` until :data:`SIBLINGS_TO_LEARN` of them ran.

A VM's own memory is its QEMU's anonymous resident pages (``RssAnon``: its heap,
translation cache and the guest pages it wrote; no QEMU shares them), read from
``/proc/PID/status`` in microseconds, for every sandbox at most every
:data:`SAMPLE_SECS`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from forkd import limits
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.vmm.jail import memory_limit

MEMINFO = Path("/proc/meminfo")
SAMPLE_SECS = 1.0  # the sandboxes' own memory is read again when older than this
SETTLE_SECS = 10.0  # a VM this young may not hold yet what it will
SIBLINGS_TO_LEARN = 3  # settled children of a snapshot before their median is its estimate
MIB = 1 << 20


@dataclass(frozen=True)
class HostMemory:
    total_mib: int
    available_mib: int


def read_meminfo(path: Path | None = None) -> HostMemory:
    """MemTotal and MemAvailable of ``path`` (default :data:`MEMINFO`), in MiB."""
    found: dict[str, int] = {}
    with open(MEMINFO if path is None else path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(rest.split()[0]) >> 10
    return HostMemory(found["MemTotal"], found["MemAvailable"])


def read_host(
    meminfo: Path | None = None, cgroup_root: Path | None = None, parent: str | None = None
) -> HostMemory:
    """What the VMs have: the host's memory (:func:`read_meminfo`), or the limit of
    the cgroup under ``cgroup_root`` they are charged to where that is tighter
    (``cgroup_root`` None: the host's only)."""
    host = read_meminfo(meminfo)
    limited = None if cgroup_root is None else memory_limit.enclosing(cgroup_root, parent)
    if limited is None:
        return host
    return HostMemory(
        min(host.total_mib, limited.limit_mib), min(host.available_mib, limited.available_mib)
    )


@dataclass
class _Seen:
    origin: str | None  # the snapshot directory it was forked from
    first_seen: float
    own_mib: float = 0.0


class MemoryWatch:
    """The host's memory and each running sandbox's own, for admission.

    ``vms()``: the running sandboxes' VMs by sandbox id.
    """

    def __init__(
        self,
        vms: Callable[[], Mapping[str, SandboxVM]],
        meminfo: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        cgroup_root: Path | None = None,
        cgroup_parent: str | None = None,
    ) -> None:
        self._vms = vms
        self._meminfo = meminfo
        self._cgroup = (cgroup_root, cgroup_parent)
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._sampled_at: float | None = None

    def host(self) -> HostMemory:
        return read_host(self._meminfo, *self._cgroup)

    def sample(self, max_age: float = SAMPLE_SECS) -> None:
        """Read every sandbox's own memory again, unless that was done ``max_age`` ago."""
        now = self._clock()
        if self._sampled_at is not None and now - self._sampled_at < max_age:
            return
        vms = self._vms()
        for gone in self._seen.keys() - vms.keys():
            del self._seen[gone]
        for sid, vm in vms.items():
            seen = self._seen.get(sid)
            if seen is None:
                origin = None if vm.origin is None else str(vm.origin)
                seen = self._seen[sid] = _Seen(origin, now)
            try:
                seen.own_mib = vm.resident_memory().get("anon", 0) / MIB
            except OSError:  # its QEMU just exited: the reaper marks it dead
                seen.own_mib = 0.0
        self._sampled_at = now

    def own_mib(self, sandbox_id: str) -> float | None:
        """What the sandbox's QEMU held of its own at the last sample."""
        seen = self._seen.get(sandbox_id)
        return None if seen is None else seen.own_mib

    def fork_estimate_mib(self, origin: Path | str | None) -> int:
        """What a sandbox forked from ``origin`` (a snapshot directory) will hold of its
        own: the median of its settled siblings', or FORK_ESTIMATE_MIB."""
        if origin is None:
            return limits.FORK_ESTIMATE_MIB
        key, now = str(origin), self._clock()
        settled = [
            s.own_mib
            for s in self._seen.values()
            if s.origin == key and now - s.first_seen >= SETTLE_SECS
        ]
        if len(settled) < SIBLINGS_TO_LEARN:
            return limits.FORK_ESTIMATE_MIB
        return max(1, round(statistics.median(settled)))

    def unsettled_mib(self) -> int:
        """What sandboxes started less than SETTLE_SECS ago will hold and do not yet."""
        now = self._clock()
        young = [s for s in self._seen.values() if now - s.first_seen < SETTLE_SECS]
        estimates = {s.origin: self.fork_estimate_mib(s.origin) for s in young}
        return round(sum(max(0.0, estimates[s.origin] - s.own_mib) for s in young))

    def sandboxes_mib(self) -> int:
        """What the running sandboxes hold of their own, in all, at the last sample."""
        return round(sum(s.own_mib for s in self._seen.values()))
