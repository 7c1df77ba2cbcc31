"""The free disk a client's data may not eat into (``--disk-reserve``).

Whatever the daemon writes on a client's behalf (an image's blobs and its root
disk, an archive sent to ``/v1/images/load``, a volume, a snapshot pulled from
a registry) is checked against the reserve before the first byte, with the size
it says it has when it says one, and again every :data:`CHECK_EVERY_BYTES` while
it is written: a registry that declares a 64 GiB layer is refused at once, and
one that streams without end is stopped once the disk is down to the reserve.
Either is :class:`~forkd.errors.NoRoom` (507), and the writer keeps nothing.
The disks of the daemon's own state (the database, its snapshots' metadata)
keep the reserve for themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from forkd.errors import NoRoom

CHECK_EVERY_BYTES = 8 << 20  # a statvfs: microseconds
MIB = 1 << 20


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s file system (its
    nearest existing ancestor's)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class DiskReserve:
    """``reserve_bytes`` kept free on the disk of ``directory`` (0: no reserve, but the
    free space still bounds a stated size)."""

    directory: Path
    reserve_bytes: int

    def require(self, need_bytes: int, doing: str) -> None:
        """:class:`NoRoom` unless ``need_bytes`` more fit above the reserve."""
        free = free_bytes(self.directory)
        if free - need_bytes < self.reserve_bytes:
            more = f" for {need_bytes / MIB:.0f} MiB more" if need_bytes else ""
            raise NoRoom(
                f"{doing} was refused: the disk has {free / MIB:.0f} MiB free{more}, and "
                f"{self.reserve_bytes / MIB:.0f} MiB are kept free (--disk-reserve); "
                "nothing was kept"
            )

    def meter(self, doing: str, expected_bytes: int = 0) -> WriteMeter:
        """A write of ``expected_bytes`` (0: unknown), checked now and as it goes."""
        self.require(expected_bytes, doing)
        return WriteMeter(self, doing)


@dataclass
class WriteMeter:
    """Counts what a write puts on the disk, checking the reserve every
    :data:`CHECK_EVERY_BYTES`."""

    reserve: DiskReserve
    doing: str
    _since: int = field(default=0, init=False)

    def will_write(self, n: int) -> None:
        """Say ``n`` bytes are about to be written: every few MiB (or for one large
        write), :class:`NoRoom` unless they fit above the reserve."""
        self._since += n
        if self._since >= CHECK_EVERY_BYTES:
            self._since = 0
            self.reserve.require(n, self.doing)
