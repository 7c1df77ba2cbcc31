"""Events followed on a second connection while a command's one request runs: what the
progress displays of ``forkd fork`` and ``forkd explore`` draw from."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from forkd.cli.options import Connection

CONNECT_WAIT_SECS = 2.0  # at most, for the event stream to follow before the request goes


@contextlib.contextmanager
def watching(
    conn: Connection,
    types: str,
    on_event: Callable[[dict[str, Any]], None],
    sandbox_id: str | None = None,
) -> Iterator[None]:
    """``on_event`` for every event of ``types`` (of ``sandbox_id``) while the block runs,
    from a thread; a display never fails the command, so its errors are dropped."""
    watcher = conn.controller()
    stop, following = threading.Event(), threading.Event()

    def follow() -> None:
        with contextlib.suppress(Exception):
            events = watcher.events(
                types, sandbox_id, reconnect_s=2.0, on_position=lambda _id: following.set()
            )
            for event in events:
                if stop.is_set():
                    return
                on_event(event)
        following.set()  # failed: nothing to wait for

    thread = threading.Thread(target=follow, name=f"watch-{types}", daemon=True)
    thread.start()
    following.wait(CONNECT_WAIT_SECS)  # the request's first events come after this
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            watcher.close()  # ends the event stream the thread reads
        thread.join(1.0)
