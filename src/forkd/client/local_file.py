"""A file downloaded from a sandbox, put in place on the client's disk whole or not at all.

The bytes come from the guest, and the directory they land in may hold what an
earlier download from it put there, links included. So the staging file is made
anew under a random name (``O_EXCL``, never through an existing name or link) beside
its target, and renamed over the target, which is replaced, not written through,
once everything came.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

DEFAULT_UMASK = 0o022  # where the process's own cannot be read without changing it


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` sets it for every
    thread at once); Linux shows it in ``/proc/self/status``."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return DEFAULT_UMASK


def _mode_for(target: Path) -> int:
    """The permission bits the finished file gets: those of the regular file it replaces,
    else what a newly created file gets here (0666 less the umask)."""
    with contextlib.suppress(OSError):
        st = target.lstat()
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    return 0o666 & ~_umask()


@contextlib.contextmanager
def staged_file(target: Path) -> Iterator[BinaryIO]:
    """A new file to write ``target``'s bytes to; renamed over ``target`` when the block
    ends without an error, removed when it raises."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".forkd-part", dir=target.parent)
    staged = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(staged, _mode_for(target))  # by name: Windows has no fchmod before 3.13
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
