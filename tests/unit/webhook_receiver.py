"""A webhook receiver for the tests: a real HTTP server on loopback, in a thread, that
keeps every request it gets and answers as it is told (ok, fail the first N, hang,
redirect)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.http_thread import in_thread


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int
    got: list[Received] = field(default_factory=list)
    fail_first: int = 0  # answer 500 to this many requests first
    status: int = 204
    hang_secs: float = 0.0
    redirect_to: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def until(self, check: Callable[[list[Received]], bool], secs: float = 10.0) -> None:
        deadline = time.monotonic() + secs
        while not check(self.got):
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver got {len(self.got)}: {self.got[-3:]}")
            time.sleep(0.05)


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            receiver.got.append(Received(self.path, headers, body))
            if receiver.hang_secs:
                time.sleep(receiver.hang_secs)
            if receiver.redirect_to is not None:
                self.send_response(302)
                self.send_header("location", receiver.redirect_to)
            elif len(receiver.got) <= receiver.fail_first:
                self.send_response(500)
            else:
                self.send_response(receiver.status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def receiving(on_port: int = 0, **behaviour: Any) -> Iterator[Receiver]:
    """A receiver on ``on_port`` (0: any free one)."""
    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", on_port), _handler(Receiver(0)))
    receiver = Receiver(server.server_address[1], **behaviour)
    server.RequestHandlerClass = _handler(receiver)
    with in_thread(server):
        yield receiver
