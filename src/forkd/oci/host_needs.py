"""What a snapshot needs of the host that restores it, recorded at push and checked at pull.

QEMU restores device state only into the same machine: the same QEMU
release (microvm is not a versioned machine type, so the release is the
version), the same accelerator class, and a CPU that has every feature the
guest saw. Under TCG the CPU is QEMU's ``max`` model, fixed by the release;
under KVM it is the host's, so the host's flags must include the source's.
The guest RAM must fit this daemon's limits, and the guest image must be the
same build (its files are checked piece by piece against the snapshot's).

:func:`mismatches` lists every difference in words, so the 409 a pull answers
names all of them at once.
"""

from __future__ import annotations

import functools
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from forkd import hosttools, limits
from forkd.errors import ForkdError
from forkd.vmm.qemu.argv import QEMU_BINARY, TCG_CPU, MachineConfig

MACHINE_TYPE = "microvm"


@functools.cache
def qemu_release() -> str:
    """``major.minor`` of this host's ``qemu-system-x86_64`` (``"unknown"`` without one)."""
    try:
        out = subprocess.run(
            [hosttools.require(QEMU_BINARY), "--version"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (ForkdError, OSError, subprocess.TimeoutExpired):
        return "unknown"
    m = re.search(r"version (\d+)\.(\d+)", out.stdout)
    return f"{m.group(1)}.{m.group(2)}" if m else "unknown"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return sorted(set(line.partition(":")[2].split()))
    return []


def of_machine(machine: MachineConfig) -> dict[str, Any]:
    """What a snapshot of ``machine``, taken on this host, needs of another."""
    needs: dict[str, Any] = {
        "arch": platform.machine(),
        "qemu": qemu_release(),
        "machine": MACHINE_TYPE,
        "accel": machine.accel,
        "cpu": TCG_CPU if machine.accel == "tcg" else "host",
        "memory_mib": machine.memory_mib,
        "vcpus": machine.vcpus,
    }
    if machine.accel == "kvm":
        needs["cpu_flags"] = cpu_flags()
    return needs


def mismatches(needs: dict[str, Any], kvm: bool, host_flags: list[str] | None = None) -> list[str]:
    """How this host differs from what ``needs`` asks, in words. ``kvm``: whether KVM runs
    guests here. A TCG snapshot restores under TCG on any host; a KVM one needs KVM."""
    found = []
    arch = platform.machine()
    if needs.get("arch") != arch:
        found.append(f"it was taken on {needs.get('arch')!r}, this host is {arch!r}")
    if needs.get("qemu") != qemu_release():
        found.append(f"it needs QEMU {needs.get('qemu')}, this host has {qemu_release()}")
    if needs.get("machine") != MACHINE_TYPE:
        found.append(f"it needs machine type {needs.get('machine')!r}, forkd runs {MACHINE_TYPE!r}")
    accel = needs.get("accel")
    if accel == "kvm" and not kvm:
        found.append("it was taken under KVM, and KVM cannot run guests on this host")
    elif accel == "kvm":
        have = set(cpu_flags() if host_flags is None else host_flags)
        wanted = needs.get("cpu_flags") or []
        if not isinstance(wanted, list) or not all(isinstance(f, str) for f in wanted):
            wanted = ["<unreadable cpu_flags>"]
        missing = sorted(set(wanted) - have)
        if missing:
            found.append(f"this host's CPU lacks {', '.join(missing[:12])}")
    elif accel != "tcg":
        found.append(f"it was taken under an unknown accelerator {accel!r}")
    elif needs.get("cpu") != TCG_CPU:
        found.append(f"it needs CPU model {needs.get('cpu')!r}, TCG here runs {TCG_CPU!r}")
    mib, vcpus = needs.get("memory_mib"), needs.get("vcpus")
    if not isinstance(mib, int) or not limits.MIN_MEMORY_MIB <= mib <= limits.MAX_MEMORY_MIB:
        found.append(f"its {mib} MiB of guest memory is outside this daemon's limits")
    if not isinstance(vcpus, int) or not 1 <= vcpus <= limits.MAX_VCPUS:
        found.append(f"its {vcpus} vCPUs are outside this daemon's limits")
    return found
