"""Room on the snapshot root's disk before a VM's memory is written to it.

Branching, building a template and hibernating write up to the guest's whole
memory onto the disk the store, the other snapshots and the volumes live on; a
full disk fails them all. So none starts while that disk has less than
``--disk-reserve`` (``Settings.disk_reserve_mib``) free: the reserve is what a
write in flight may eat into, and one that fills the disk anyway is removed
(the failure tables). Reclaim, which hibernates one sandbox after another on
its own, also keeps the guest's whole memory free besides the reserve
(:meth:`forkd.controller.services.hibernation.HibernateService.check_disk`).
"""

from __future__ import annotations

from pathlib import Path

from forkd.disk_reserve import free_bytes
from forkd.errors import StorageFull


def require_room(directory: Path, need_mib: int, doing: str) -> None:
    """:class:`StorageFull` unless ``directory``'s disk has ``need_mib`` free; ``doing``
    names the write in the message."""
    free_mib = free_bytes(directory) >> 20  # its nearest existing ancestor's disk
    if free_mib < need_mib:
        raise StorageFull(
            f"{doing} needs {need_mib} MiB free on the disk at {directory} before it "
            f"writes the guest's memory (--disk-reserve), but it has {free_mib} MiB free"
        )
