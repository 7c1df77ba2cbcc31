"""Room on the state directory's disk before a VM's memory is written to it.

Hibernating and branching write up to the guest's whole memory. Each is refused
before anything is paused or written unless the disk holds that and keeps
:data:`DISK_RESERVE_MIB` free besides: the store, the other snapshots and the
volumes live on the same disk, and a full one fails them all (a token holder
branching in a loop, or reclaim hibernating under memory pressure, must not
get there).
"""

from __future__ import annotations

from pathlib import Path

from forkd.errors import StorageFull
from forkd.vmm.volumes.disks import free_bytes

DISK_RESERVE_MIB = 1024


def require_room(directory: Path, memory_mib: int, doing: str) -> None:
    """:class:`StorageFull` unless ``directory``'s disk holds ``memory_mib`` and keeps
    :data:`DISK_RESERVE_MIB` free; ``doing`` names the write in the message."""
    free_mib = free_bytes(directory if directory.exists() else directory.parent) >> 20
    if free_mib < memory_mib + DISK_RESERVE_MIB:
        raise StorageFull(
            f"{doing} may write up to {memory_mib} MiB and must leave {DISK_RESERVE_MIB} MiB "
            f"free, but the disk at {directory} has {free_mib} MiB free"
        )
