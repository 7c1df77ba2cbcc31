"""The memory limit the host's VMs are charged against, when there is one.

A daemon in a container (a cgroup with a memory limit, seen through a cgroup
namespace as the root of ``/sys/fs/cgroup``), or under a limit an operator set on
the VMs' parent group (``forkd serve --cgroup-parent``), must count what that limit
leaves, not what the whole host has: ``MemAvailable`` would admit sandboxes that the
limit's OOM killer then ends. What a limited group has available is its limit less
what is charged to it, plus the file cache charged to it that the kernel can drop
(``inactive_file``), as ``MemAvailable`` counts the host's.

cgroup v2 (``memory.max``, ``memory.current``, ``memory.stat``) and v1's memory
controller (``memory.limit_in_bytes``, ``memory.usage_in_bytes``) alike. Standard
library only; nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 says "no limit" with a number near 2**63
MIB = 1 << 20


@dataclass(frozen=True)
class CgroupMemory:
    """A limited group: its limit and what it has available, in MiB."""

    limit_mib: int
    available_mib: int


def enclosing(root: Path = CGROUP_ROOT, parent: str | None = None) -> CgroupMemory | None:
    """The tightest limit among the cgroup root this process sees and the VMs' parent
    group under it; None when neither has a limit (or no cgroup file is readable)."""
    base = root if (root / "cgroup.controllers").exists() else root / "memory"
    dirs = [base] if parent is None else [base, base / parent]
    limited = [found for d in dirs if (found := _read(d)) is not None]
    return min(limited, key=lambda g: g.available_mib, default=None)


def _read(group: Path) -> CgroupMemory | None:
    v2 = (group / "memory.max").exists()
    limit = _number(group / ("memory.max" if v2 else "memory.limit_in_bytes"))
    if limit is None or limit >= UNLIMITED:
        return None
    usage = _number(group / ("memory.current" if v2 else "memory.usage_in_bytes")) or 0
    droppable = _stat(group / "memory.stat", "inactive_file" if v2 else "total_inactive_file")
    available = max(0, limit - usage + droppable)
    return CgroupMemory(limit // MIB, min(limit, available) // MIB)


def _number(path: Path) -> int | None:
    """The number in a cgroup file; None for "max", a missing or unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
