"""A plain-HTTP server on loopback that counts every connection it accepts and answers
every request alike: what a push or a pull may (or may not) reach on the daemon's host,
a registry answering an error with a body, or any other service on a loopback port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Answer:
    status: int = 404
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    reason: str | None = None  # the status line's phrase; None: the standard one


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer: Answer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.accepted = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self.lock:
            self.accepted += 1
        return True


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        a = self.server.answer
        with self.server.lock:
            self.server.paths.append(f"{self.command} {self.path}")
        self.send_response(a.status, a.reason)
        for name, value in a.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(a.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(a.body)

    do_GET = do_HEAD = do_POST = do_PUT = _answer

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Listening:
    address: str  # 127.0.0.1:PORT
    server: _Server

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        with self.server.lock:
            return self.server.accepted

    @property
    def paths(self) -> list[str]:
        with self.server.lock:
            return list(self.server.paths)


@contextmanager
def listening(answer: Answer | None = None) -> Iterator[Listening]:
    """A server on a free loopback port for the block, answering ``answer`` to all."""
    server = _Server(answer or Answer())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Listening(f"127.0.0.1:{server.server_address[1]}", server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
