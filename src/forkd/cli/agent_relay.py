"""The original forkd agent protocol, served on the host for one sandbox of the daemon.

The original forkd SDK's ``Sandbox()`` runs ``forkd fork --tag T -n 1 --settle-secs S``
and then speaks the agent protocol to a fixed address, ``FORKD_TARGET``. ``forkd fork
--settle-secs`` holds the sandboxes it forked and, given that address, serves the
protocol there with this relay: each request becomes the daemon's HTTP call for the
sandbox (``ping``, ``exec``, ``eval``), so it works with the daemon's token, without
root, and with user-mode networking, where no ``guest_addr`` exists.

Framing, as the original agent's: one JSON object per connection, ended by a newline
or by the client closing its side; one JSON answer and a newline; then the close.
Answers have the original's shapes: ``error`` only when something failed (the
original client takes the key as a failure), an eval's error as one line with the
whole text in ``traceback``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from forkd.client import Controller, ControllerError
from forkd.client.guest_agent import LineTooLong, read_line

MAX_REQUEST_BYTES = 1 << 20  # as the guest agent's TCP_MAX_REQUEST_BYTES
READ_TIMEOUT_SECS = 5.0  # the whole request, as the guest agent
DEFAULT_EXEC_TIMEOUT_SECS = 30  # the original SDK's exec default


class RelayError(Exception):
    """A request the relay cannot serve: its message is the answer's ``error``."""


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a socket address; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"FORKD_TARGET must be HOST:PORT, got {address!r}")
    return host, int(port)


def answer(ctl: Controller, sandbox_id: str, request: dict[str, Any]) -> dict[str, Any]:
    """The original agent's answer to ``request``, served by the daemon for ``sandbox_id``."""
    action = request.get("action")
    try:
        if action == "ping":
            return dict(ctl.ping_sandbox(sandbox_id))
        if action == "exec":
            return _exec(ctl, sandbox_id, request)
        if action == "eval":
            return _eval(ctl, sandbox_id, request)
        raise RelayError(f"unknown action: {action!r} (expected one of ping, exec, eval)")
    except (RelayError, ControllerError) as exc:
        return {"error": str(exc), "exit_code": 1}


def _exec(ctl: Controller, sandbox_id: str, request: dict[str, Any]) -> dict[str, Any]:
    args = request.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise RelayError("'args' must be a non-empty list of strings")
    timeout = request.get("timeout", request.get("timeout_secs", DEFAULT_EXEC_TIMEOUT_SECS))
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise RelayError("'timeout' must be a positive number of seconds")
    ran = ctl.exec_command(sandbox_id, args, timeout_secs=timeout)
    return {k: ran[k] for k in ("stdout", "stderr", "exit_code") if k in ran}


def _eval(ctl: Controller, sandbox_id: str, request: dict[str, Any]) -> dict[str, Any]:
    code = request.get("code")
    if not isinstance(code, str):
        raise RelayError("'code' must be a string")
    result = dict(ctl.eval_code(sandbox_id, code))
    error = result.pop("error", None)
    if error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        result["error"] = lines[-1] if lines else str(error)
        result["traceback"] = error
    return result


class AgentRelay(socketserver.ThreadingTCPServer):
    """Serves the protocol at ``address`` for ``sandbox_id``, a thread per connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], connect: Callable[[], Controller], sandbox_id: str
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.connect = connect
        self.sandbox_id = sandbox_id
        super().__init__(address, _Handler)

    def serve_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="agent-relay", daemon=True)
        thread.start()
        return thread


class _Handler(socketserver.BaseRequestHandler):
    server: AgentRelay

    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            data = _read_request(sock)
            try:
                request = json.loads(data)
            except ValueError:
                request = None
            if not isinstance(request, dict):
                reply: dict[str, Any] = {
                    "error": "the request is not a JSON object",
                    "exit_code": 1,
                }
            else:
                with self.server.connect() as ctl:
                    reply = answer(ctl, self.server.sandbox_id, request)
        except RelayError as exc:
            reply = {"error": str(exc), "exit_code": 1}
        except OSError:
            return  # the client went away
        with contextlib.suppress(OSError):  # the client went away
            sock.sendall(json.dumps(reply).encode() + b"\n")


def _read_request(sock: socket.socket) -> bytes:
    """The bytes before the first newline (or EOF), within the size and time caps."""
    sock.settimeout(READ_TIMEOUT_SECS)
    try:
        return read_line(sock, MAX_REQUEST_BYTES, "request")
    except TimeoutError as exc:
        raise RelayError(f"no complete request within {READ_TIMEOUT_SECS:g} s") from exc
    except LineTooLong as exc:
        raise RelayError(str(exc)) from exc
