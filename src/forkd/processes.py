"""A process told apart from a later one that reuses its pid: its pid and start time.

Part of the base: the QEMU uid registry (:mod:`forkd.vmm.jail.qemu_user`) names the
process holding each uid by it, and an import marks what it leaves on disk with it
(:mod:`forkd.image_import.leftovers`), so a later process can tell whether the one
that made something still runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_MARK = re.compile(r"@(\d+)\.(\d+)\.")


@dataclass(frozen=True)
class Holder:
    """A process, told apart from a later one with the same pid by its start time."""

    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: clock ticks after boot

    @classmethod
    def of(cls, pid: int) -> Holder | None:
        """Process ``pid`` as it is now; None when it is gone (a zombie is gone)."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return None
        # The command name (field 2) is in parentheses and may hold anything.
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) < 20 or fields[0] in (b"Z", b"X"):
            return None
        return cls(pid, int(fields[19]))

    def alive(self) -> bool:
        return Holder.of(self.pid) == self

    def mark(self) -> str:
        """``@PID.TICKS.``: this process named in a file's name (:func:`marked_by`)."""
        return f"@{self.pid}.{self.start_ticks}."


def mark() -> str:
    """This process's mark, to put in the name of what it makes: ``@PID.TICKS.``."""
    me = Holder.of(os.getpid())
    assert me is not None
    return me.mark()


def live_marked_files(directory: Path) -> Iterator[tuple[Holder, Path]]:
    """The files of ``directory`` whose names carry a mark (:func:`mark`) of a process
    still running, each with that process; a file whose process is gone is removed, an
    unmarked one passed over, a missing directory holds none."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        holder = marked_by(name)
        if holder is None:
            continue
        path = directory / name
        if holder.alive():
            yield holder, path
        else:
            path.unlink(missing_ok=True)


def marked_by(name: str) -> Holder | None:
    """The process a name's mark (:func:`mark`) names, or None when it has none."""
    found = _MARK.search(name)
    return Holder(int(found[1]), int(found[2])) if found else None
