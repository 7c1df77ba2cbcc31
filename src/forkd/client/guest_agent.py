"""A direct connection to a sandbox's guest agent at its ``guest_addr``, past the daemon.

The agent's TCP protocol (docs/guest-agent.md, "TCP port 8888"): one JSON
request per connection, one JSON answer, then the agent closes. Only the
daemon's host can reach ``guest_addr``.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.results import CommandResult, EvalResult, exit_code_of

CONNECT_TIMEOUT_SECS = 10.0
ANSWER_MARGIN_SECS = 10.0  # beyond a command's own timeout, for the answer to come back
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class GuestAgent:
    """The guest agent at ``guest_addr`` (``"10.201.0.6:8888"``, from SandboxInfo).

    Errors raise :class:`ControllerError`: ``status`` 0 when the agent could
    not be reached or closed without answering, 400 when it answered
    ``ok: false`` (``body`` holds that answer).

    Example::

        sb = Sandbox("py")
        agent = GuestAgent(sb.info["guest_addr"])
        print(agent.eval("x = 41; x + 1").result)   # '42', the same interpreter as sb.eval
    """

    def __init__(self, guest_addr: str, timeout: float = 60.0) -> None:
        host, sep, port = guest_addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"guest_addr must be HOST:PORT, got {guest_addr!r}")
        self.address = (host.strip("[]"), int(port))
        self.timeout = timeout

    def request(self, action: str, wait: float | None = None, **fields: Any) -> JSONDict:
        """Send one request; the agent's answer (``ok`` is true)."""
        line = json.dumps({"action": action, **fields}).encode() + b"\n"
        where = f"guest agent at {self.address[0]}:{self.address[1]}"
        try:
            with socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_SECS) as sock:
                sock.settimeout(wait if wait is not None else self.timeout)
                sock.sendall(line)
                data = read_line(sock)
        except OSError as exc:
            raise ControllerError(0, f"{where}: {exc}") from exc
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ControllerError(0, f"{where} did not answer with a JSON object")
        if answer.get("ok") is not True:
            raise ControllerError(400, str(answer.get("error") or "error"), answer)
        return answer

    def ping(self) -> JSONDict:
        """``{"ok": true, "pong": true, "pid", "hostname", "uptime_s", "agent_version"}``."""
        return self.request("ping")

    def exec(
        self,
        args: list[str],
        timeout: float = 30,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
    ) -> CommandResult:
        """Run a program (no shell) and wait for it; a non-zero exit is not an exception."""
        raw = self.request(
            "exec",
            wait=timeout + ANSWER_MARGIN_SECS,
            args=list(args),
            timeout_secs=timeout,
            cwd=cwd,
            env=env or {},
            stdin=stdin,
        )
        return CommandResult(
            raw.get("stdout") or "", raw.get("stderr") or "", exit_code_of(raw), raw
        )

    def eval(self, code: str, timeout: float = 60) -> EvalResult:
        """Run Python in the sandbox's warm interpreter, the one ``Sandbox.eval`` uses;
        the agent interrupts it after ``timeout`` seconds."""
        # The agent's grace for stopping an eval past its timeout is 5 s.
        wait = timeout + 5 + ANSWER_MARGIN_SECS
        return EvalResult.from_answer(self.request("eval", wait=wait, code=code, timeout_s=timeout))


class LineTooLong(ConnectionError):
    """A message of the agent protocol past its size cap."""


def read_line(sock: socket.socket, limit: int = MAX_ANSWER_BYTES, what: str = "answer") -> bytes:
    """Everything up to the first newline, or to EOF: one message of the agent protocol.
    :class:`LineTooLong` past ``limit`` bytes (``what`` names it in the message)."""
    buf = bytearray()
    while b"\n" not in buf:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise LineTooLong(f"{what} longer than {limit} bytes")
    return bytes(buf).split(b"\n", 1)[0]
