"""How long one image import may take in all (``--import-timeout``), whatever it waits on.

Each registry transfer has a deadline of its own (a minute, plus a second a MiB),
but an image may have 256 layers, each trickled just inside its own: hours for
one import, and two such imports take every import slot. So an import's thread
runs inside :func:`import_deadline`, and everything the import waits on is held
to it as well: every read and write of a registry connection
(:mod:`forkd.oci.connect`), every piece copied into the blob store, and the
worker that flattens the layers (killed at the deadline). Past it, the import
fails with :class:`~forkd.errors.TimedOut` (504) and keeps nothing it had not
whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

from forkd.errors import TimedOut

_DEADLINE: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "forkd_import_deadline", default=None
)  # (when, the seconds it was given), in time.monotonic()


@contextlib.contextmanager
def import_deadline(seconds: float) -> Iterator[None]:
    """Within the block (one thread's import), what the import waits on ends ``seconds``
    from now."""
    token = _DEADLINE.set((time.monotonic() + seconds, seconds))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def deadline() -> float | None:
    """When this thread's import must be over (``time.monotonic()``), None: no bound."""
    current = _DEADLINE.get()
    return None if current is None else current[0]


def check(doing: str = "the image import") -> None:
    """:class:`TimedOut` when this thread's import is past its deadline."""
    current = _DEADLINE.get()
    if current is not None and time.monotonic() > current[0]:
        raise TimedOut(
            f"{doing} ran past --import-timeout ({current[1]:.0f} s): stopped, nothing "
            "half-made was kept"
        )
