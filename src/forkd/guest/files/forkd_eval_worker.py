"""The eval worker's side of its pipes: serves the agent's eval, interrupt and reseed
requests in the image's own Python, with forkd_eval's runner.

Started by forkd-eval-worker.py (which checked the Python's version and loaded
this module and forkd_eval from /opt/forkd) in a container image, where the
agent's own Python is forkd's and not the image's. One request per line on
``in_fd``, one answer per line on ``out_fd``, JSON both ways:

    agent -> worker  {"id": 3, "op": "eval", "code": "x + 1", "timeout_s": 60}
                     {"id": 4, "op": "interrupt"}
                     {"id": 5, "op": "reseed", "seed": 1234}
    worker -> agent  {"id": 3, "ok": true, "result": {...forkd_eval's answer...}}
                     {"id": 4, "ok": false, "error": "message"}

Evals run on the main thread as in the agent, so an interrupt (SIGINT) wakes
a blocking call; each eval waits for its answer on a thread of its own, so an
interrupt or a reseed is answered while one runs. At the end of ``in_fd`` (the
agent is gone) the worker exits. Standard library only; Python 3.8 and later.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import forkd_eval

MAX_REQUEST_BYTES = 64 * 1024 * 1024  # a longer line is dropped (the agent sends none)
READ_CHUNK_BYTES = 1024 * 1024


def read_lines(fd: int, max_bytes: int) -> Iterator[bytes]:
    """Each line read from ``fd`` (without its newline) until its end; a line longer
    than ``max_bytes`` is dropped whole. Both ends of the pipe frame lines so."""
    parts: list[bytes] = []  # of the line so far: joined once, at its newline
    size = 0
    dropping = False
    while chunk := os.read(fd, READ_CHUNK_BYTES):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if not dropping:
                yield b"".join([*parts, chunk[start:end]])
            parts, size, dropping, start = [], 0, False, end + 1
        rest = chunk[start:]
        if not dropping and rest:
            parts.append(rest)
            size += len(rest)
            if size > max_bytes:
                parts, size, dropping = [], 0, True


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"


class Pipes:
    """Lines in from the agent, whole answers out to it (one writer at a time)."""

    def __init__(self, in_fd: int, out_fd: int) -> None:
        self.in_fd = in_fd
        self.out_fd = out_fd
        self._write_lock = threading.Lock()

    def lines(self) -> Iterator[bytes]:
        return read_lines(self.in_fd, MAX_REQUEST_BYTES)

    def answer(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._write_lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self.out_fd, view) :]


class Worker:
    """One image interpreter's evals, in one ``__main__`` namespace."""

    def __init__(self, pipes: Pipes) -> None:
        self.pipes = pipes
        self.module = types.ModuleType("__main__")
        self.runner = forkd_eval.EvalRunner(self.module)
        self.ops: dict[str, Callable[[dict[str, Any]], Any]] = {
            "interrupt": lambda req: {"interrupted": self.runner.interrupt(_tag(req))},
            "reseed": self._reseed,
        }

    def _reseed(self, req: dict[str, Any]) -> dict[str, Any]:
        seed = req.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError("'seed' must be an integer")
        forkd_eval.reseed_python_rngs(seed)
        return {}

    def handle(self, line: bytes) -> None:
        try:
            req = json.loads(line)
        except ValueError:
            return
        if not isinstance(req, dict) or not isinstance(req.get("id"), int):
            return
        if req.get("op") == "eval":
            thread = threading.Thread(target=self._eval, args=(req,), name="eval-wait")
            thread.daemon = True
            thread.start()
            return
        self._answer(req, self.ops.get(str(req.get("op"))))

    def _eval(self, req: dict[str, Any]) -> None:
        def run(req: dict[str, Any]) -> Any:
            code, timeout_s = forkd_eval.eval_params(req)
            return self.runner.run(code, timeout_s, _tag(req))

        self._answer(req, run)

    def _answer(self, req: dict[str, Any], op: Callable[[dict[str, Any]], Any] | None) -> None:
        try:
            if op is None:
                raise ValueError("unknown op: {!r}".format(req.get("op")))
            message = {"id": req["id"], "ok": True, "result": op(req)}
        except Exception as exc:
            message = {"id": req["id"], "ok": False, "error": str(exc) or type(exc).__name__}
        self.pipes.answer(message)

    def read_requests(self) -> None:
        """Handle each request line; at the end of the pipe the worker exits."""
        try:
            for line in self.pipes.lines():
                self.handle(line)
        finally:
            os._exit(0)  # the eval thread may be deep in user code: end it too


def serve(in_fd: int, out_fd: int) -> None:
    """Serve the agent on these fds until it closes ``in_fd``; evals on this thread."""
    pipes = Pipes(in_fd, out_fd)
    worker = Worker(pipes)
    sys.modules["__main__"] = worker.module  # pickling user classes finds them
    worker.runner.claim_thread()  # before any request can arrive
    reader = threading.Thread(target=worker.read_requests, name="requests")
    reader.daemon = True
    reader.start()
    version = "{}.{}.{}".format(*sys.version_info[:3])
    pipes.answer({"ready": True, "python": version, "executable": sys.executable})
    worker.runner.serve_forever()


def _tag(req: dict[str, Any]) -> str | None:
    """A request's ``tag`` (which eval an interrupt may stop), if it is a string."""
    tag = req.get("tag")
    return tag if isinstance(tag, str) else None
