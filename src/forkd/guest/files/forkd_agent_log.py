"""The guest agent's log: one line on stderr (the guest's console) per event.

Imported by the agent's modules from their own directory. Standard library only.
"""

from __future__ import annotations

import contextlib
import os


def log(message: str) -> None:
    """Write one line to stderr via the fd, so eval's stderr capture never sees it."""
    with contextlib.suppress(OSError):
        os.write(2, f"forkd-agent: {message}\n".encode(errors="replace"))
