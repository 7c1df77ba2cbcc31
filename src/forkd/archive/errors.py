"""What reading or unpacking an untrusted tar archive can fail with.

    ArchiveError (ValueError)
    ├── BadArchive        not a tar archive, or one that breaks its own format
    ├── UnsafeEntry       an entry that would land, point or reach outside the target
    └── ArchiveTooLarge   more entries, bytes or header than the caller allows

Every message names the entry (as the archive spells it, shortened) and the
reason, never a path on the host. Standard library only: the SDK and the
guest agent import this package.
"""

from __future__ import annotations

NAME_SHOWN_CHARS = 200  # of an entry's name in a message


class ArchiveError(ValueError):
    """An archive refused; nothing more of it is written."""


class BadArchive(ArchiveError):
    """The bytes are not a tar archive, or it ends in the middle of one."""


class UnsafeEntry(ArchiveError):
    """An entry that unpacking would have to place, link or follow outside the target."""


class ArchiveTooLarge(ArchiveError):
    """More entries, bytes, path or header than the limits allow."""


def shown(name: str) -> str:
    """An entry's name fit for a message: quoted, control characters escaped, shortened."""
    if len(name) > NAME_SHOWN_CHARS:
        name = name[:NAME_SHOWN_CHARS] + "..."
    return repr(name)
