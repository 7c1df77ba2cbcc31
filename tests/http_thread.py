"""A test's HTTP server on loopback, serving from a thread of the test's own process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer


@contextmanager
def in_thread(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    """``server`` serving for the block, then shut down and closed."""
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
