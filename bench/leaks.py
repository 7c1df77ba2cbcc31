"""What one forkd daemon has on this host: its QEMUs, namespaces, host veths, cgroups and files.

``bench/soak.py`` takes a :class:`Census` after cleanup, where everything in
it is a leak; ``tests/integration/test_crash_restart.py`` takes one after
each restart of a killed daemon and checks that each thing in it belongs to
a sandbox the daemon lists. A daemon is known by its state directory and the
id prefix its registry keeps (``meta.id_prefix`` in ``forkd.db``): every VM
it starts is named ``sb-<prefix>-<n>`` or ``tpl-<prefix>-<n>``, and that
name is its run directory, its namespace (``forkd-<name>``) and its cgroup.
Other daemons on the host, and what they leaked, are not counted.

Imported by name with this folder on ``sys.path``, like ``benchlib``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from forkd.controller.services.live_vms import vm_id_prefixes
from forkd.vmm.jail import addresses, cgroups, network
from forkd.vmm.qemu.host_processes import qemu_pids_under, qemu_run_dirs

STAGING_GLOB = ".*.partial-*"  # a snapshot, volume or delete in progress (or a crash's)


def id_prefix(state_dir: Path) -> str | None:
    """The daemon's VM id prefix from its registry (read-only), None before its first start."""
    db = state_dir / "forkd.db"
    if not db.exists():
        return None
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'id_prefix'").fetchone()
    return row[0] if row else None


# ------------------------------------------------------------------ host veths


@dataclass(frozen=True)
class Veth:
    """A host-side ``fkh-*`` link and the namespace its peer is in (None: not found)."""

    name: str
    index: int
    peer_netns: str | None


def host_veths() -> set[Veth]:
    """Every ``fkh-*`` link on the host, with the ``/run/netns`` name its peer lives in."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        nsid_names: dict[int, str] = {}
        if network.NETNS_DIR.is_dir():
            for entry in network.NETNS_DIR.iterdir():
                with contextlib.suppress(OSError):
                    fd = os.open(entry, os.O_RDONLY)
                    try:
                        nsid = (ipr.get_netnsid(fd=fd) or {}).get("nsid")
                    finally:
                        os.close(fd)
                    if nsid is not None and nsid >= 0:
                        nsid_names[nsid] = entry.name
        found = set()
        for link in ipr.get_links():
            name = link.get("ifname") or ""
            if name.startswith(addresses.HOST_IF_PREFIX):
                nsid = link.get("IFLA_LINK_NETNSID")
                found.add(Veth(name, link["index"], nsid_names.get(nsid)))
        return found


def new_veths(before: set[Veth], after: set[Veth], foreign_netns: set[str]) -> set[Veth]:
    """Links of ``after`` not in ``before`` (by name and index), less those of other daemons.

    A veth whose peer is in a namespace of another daemon is that daemon's;
    one whose peer namespace has no name any more (a namespace kept alive by a
    process after its ``/run/netns`` entry went) is counted: it is a leak too.
    """
    old = {(v.name, v.index) for v in before}
    return {v for v in after if (v.name, v.index) not in old and v.peer_netns not in foreign_netns}


# ------------------------------------------------------------------ the census


@dataclass
class Census:
    """One daemon's things on the host at one moment (names, so a test can say which)."""

    qemu: dict[int, str] = field(default_factory=dict)  # pid -> its run dir's name (VM id)
    netns: set[str] = field(default_factory=set)  # forkd-<VM id>
    foreign_netns: set[str] = field(default_factory=set)  # forkd-* of other daemons
    cgroups: set[str] = field(default_factory=set)  # <VM id>, in any controller's hierarchy
    run_entries: set[str] = field(default_factory=set)  # <state>/run/*
    staging: set[str] = field(default_factory=set)  # .*.partial-* under snapshots/ and volumes/
    snapshot_dirs: set[str] = field(default_factory=set)  # committed snapshot directories
    volume_dirs: set[str] = field(default_factory=set)  # <state>/volumes/<name>
    volume_layers: set[str] = field(default_factory=set)  # <name>/layers/<file>

    def names(self) -> dict[str, list[str]]:
        """Each kind's things, sorted (a QEMU as ``pid (VM id)``)."""
        out = {k: sorted(getattr(self, k)) for k in self.counts() if k != "qemu"}
        return {"qemu": [f"{pid} ({vm})" for pid, vm in sorted(self.qemu.items())], **out}

    def counts(self) -> dict[str, int]:
        return {
            "qemu": len(self.qemu),
            "netns": len(self.netns),
            "cgroups": len(self.cgroups),
            "run_entries": len(self.run_entries),
            "staging": len(self.staging),
            "snapshot_dirs": len(self.snapshot_dirs),
            "volume_dirs": len(self.volume_dirs),
            "volume_layers": len(self.volume_layers),
        }


def _names(d: Path, pattern: str = "*") -> set[str]:
    return {p.name for p in d.glob(pattern)} if d.is_dir() else set()


def take_census(
    state_dir: Path,
    prefix: str,
    *,
    snapshot_root: Path | None = None,
    cgroup_root: Path = cgroups.CGROUP_ROOT,
    cgroup_parent: str = cgroups.DEFAULT_PARENT,
) -> Census:
    """What the daemon with state dir ``state_dir`` and id ``prefix`` has right now."""
    mine = vm_id_prefixes(prefix)
    run_dir = state_dir / "run"
    snap_root = snapshot_root or state_dir / "snapshots"
    vol_root = state_dir / "volumes"
    c = Census()
    # Any QEMU naming a path of this daemon counts, whatever its run dir is called.
    named = qemu_run_dirs(run_dir)
    for pid in qemu_pids_under(state_dir):
        c.qemu[pid] = named[pid].name if pid in named else "?"
    for name in network.HostNetwork.namespaces():
        (c.netns if name[len(addresses.NETNS_PREFIX) :].startswith(mine) else c.foreign_netns).add(
            name
        )
    hierarchy = cgroups.probe(cgroup_root, cgroup_parent)  # probe: creates nothing
    for parent in hierarchy.parent_dirs():
        c.cgroups |= {n for n in _names(parent) if n.startswith(mine) and (parent / n).is_dir()}
    c.run_entries = _names(run_dir)
    c.staging = _names(snap_root, STAGING_GLOB) | _names(vol_root, STAGING_GLOB)
    c.snapshot_dirs = {
        n for n in _names(snap_root) if not n.startswith(".") and (snap_root / n).is_dir()
    }
    c.volume_dirs = {n for n in _names(vol_root) if not n.startswith(".")}
    for vol in c.volume_dirs:
        c.volume_layers |= {f"{vol}/layers/{n}" for n in _names(vol_root / vol / "layers")}
    return c


# ------------------------------------------------------------------ removal


def remove_leftovers(state_dir: Path, prefix: str | None) -> None:
    """After the daemon stopped: kill its QEMUs, remove its VMs' namespaces and cgroups.

    A safety net for a run that failed half-way; it runs after the census.
    """
    for pid in qemu_pids_under(state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if prefix is None:
        return
    time.sleep(0.2)  # let the killed QEMUs leave their namespaces and groups
    if not network.netns_problems():
        network.remove_unused(vm_id_prefixes(prefix), live=set())
    cgroups.detect().remove_unused(vm_id_prefixes(prefix))
