"""What a test runs as another uid must be where that uid can read it.

A checkout often lies under a directory closed to other users (cloned under
``/root``, as root on a fresh Debian 12 does, or any 0700 parent): another uid can
then run neither the venv's ``bin/python`` nor the checkout's files. So a test
running code as another uid runs the interpreter behind the venv (Debian's
``/usr/bin/python3.11``, open to everyone) with the standard library only, stages the
files it needs in a directory of its own under ``/tmp`` that everyone may read, or
imports as root and drops its uid afterwards (as the product's own confined children
do).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The interpreter the venv was made from: outside the checkout, executable by anyone.
SYSTEM_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))


@contextlib.contextmanager
def world_readable_copy(source: Path, prefix: str = "forkd-staged-") -> Iterator[Path]:
    """A copy of the directory ``source`` under a new directory in /tmp, every directory
    0755 and file 0644 (0755 when executable); removed after. Yields the copy's path."""
    holder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        holder.chmod(0o755)
        copy = holder / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for root, _dirs, files in os.walk(copy):
            os.chmod(root, 0o755)
            for name in files:
                path = os.path.join(root, name)
                os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
        yield copy
    finally:
        shutil.rmtree(holder, ignore_errors=True)
