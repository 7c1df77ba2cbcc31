"""A lock file shared by every process on the host: ``flock`` on ``<path>``.

Part of the base. Each use opens the file afresh, so two threads of one process
exclude each other as two processes do; the lock goes with the descriptor, so a
process that dies holding it lets go.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path, *, shared: bool = False) -> Iterator[None]:
    """Hold ``path``'s lock (made 0600 when missing) for the block: exclusive, or
    ``shared`` with other shared holders. Not re-entrant: a thread holding it must not
    ask again."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it
