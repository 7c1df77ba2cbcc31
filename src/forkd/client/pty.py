"""``sandbox.pty``: interactive terminals in a sandbox, their bytes over a WebSocket.

The shape is E2B's: ``create(cols, rows)`` starts a shell in a terminal and
returns a :class:`PtyHandle` with ``pid``, ``send_stdin()``, ``resize()``,
``kill()``, ``wait()`` and iteration over the output bytes; ``connect(pid)``
opens the terminal of a process that is already running (from another
client, or in a fork of the sandbox). The socket is the route
``GET /v1/sandboxes/{id}/processes/{pid}/pty`` (docs/API.md, "Terminals").
"""

from __future__ import annotations

import contextlib
import json
import queue
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import wsproto.events
from httpx_ws import HTTPXWSException, WebSocketDisconnect, WebSocketNetworkError, WebSocketSession

from forkd.client.errors import ControllerError
from forkd.client.websockets import open_websocket, upgrade_headers

if TYPE_CHECKING:
    from forkd.client.controller import Controller
    from forkd.client.sandbox import Sandbox

# The user's login shell: bash where the image has it, else sh.
LOGIN_SHELL = ["/bin/sh", "-c", "[ -x /bin/bash ] && exec /bin/bash -l; exec /bin/sh -l"]
CLOSE_NORMAL = 1000
APP_CLOSE_BASE = 4000  # the daemon closes with 4000 + the HTTP status of a failure
MAX_SIDE = 1000  # columns or rows of a terminal (the daemon's bound)
DataCallback = Callable[[bytes], object]


def open_socket(controller: Controller, sandbox_id: str, pid: int, offset: int) -> Any:
    """A context manager: the WebSocket of process ``pid``'s terminal, output from ``offset``.

    A refusal (unknown sandbox or process, no terminal, a bad token) raises
    :class:`ControllerError` with the daemon's status and message.
    """
    return _connect(controller, f"{controller._procs(sandbox_id, pid)}/pty", offset)


def _connect(controller: Controller, path: str, offset: int) -> Any:
    return open_websocket(
        controller._client, controller.url, path, upgrade_headers(), params={"offset": offset}
    )


class PtyState:
    """What a terminal handle tracks of its socket's frames (the sync and async handle):
    where the output resumes, whether the process exited and with what code."""

    def __init__(
        self, sandbox_id: str, pid: int, offset: int, on_data: DataCallback | None
    ) -> None:
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.offset = offset
        self.on_data = on_data
        self.exit_code: int | None = None
        self.exited = False

    def _frame(self, event: wsproto.events.Event) -> bytes | None:
        """The output bytes of one frame; None for a control frame (acted upon)."""
        if isinstance(event, wsproto.events.BytesMessage):
            data = bytes(event.data)
            self.offset += len(data)
            if self.on_data is not None:
                self.on_data(data)
            return data
        if isinstance(event, wsproto.events.TextMessage):
            self._control(json.loads(event.data))
        return None

    def _control(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "exit":
            self.exit_code = message.get("exit_code")
            self.exited = True
        elif kind == "gap":
            self.offset = int(message["to"])
        elif kind == "error":  # a keystroke or resize the daemon could not pass on
            raise ControllerError(
                int(message.get("status") or 400), str(message.get("error")), message
            )

    def _closed(self, code: int, reason: str | None) -> ControllerError:
        """The error of a socket the daemon closed before the exit frame."""
        status = code - APP_CLOSE_BASE if code >= APP_CLOSE_BASE else 0
        return ControllerError(status, reason or f"the terminal socket closed ({code})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sandbox={self.sandbox_id!r}, pid={self.pid})"


def resize_message(cols: int, rows: int) -> str:
    """The frame asking for a new terminal size (checked against the daemon's bound)."""
    if not (1 <= cols <= MAX_SIDE and 1 <= rows <= MAX_SIDE):
        raise ValueError(f"a terminal is 1 to {MAX_SIDE} columns and rows, not {cols}x{rows}")
    return json.dumps({"type": "resize", "cols": int(cols), "rows": int(rows)})


class PtyHandle(PtyState):
    """A process in a terminal in a sandbox, connected over a WebSocket.

    Iterating gives the terminal's output bytes as they come, until the
    process exits (then :attr:`exit_code` is set); ``on_data`` is called
    with each piece too. :meth:`close` disconnects and leaves the process
    running; :meth:`kill` ends it. :attr:`offset` is where the next output
    starts: ``connect(pid, offset=h.offset)`` resumes without loss.

    Example::

        with sb.pty.create(cols=100, rows=30) as term:
            term.send_stdin("stty size; exit 3\\n")
            out = b"".join(term)          # until the shell exits
            assert term.exit_code == 3 and b"30 100" in out
    """

    def __init__(
        self,
        controller: Controller,
        sandbox_id: str,
        pid: int,
        offset: int = 0,
        on_data: DataCallback | None = None,
    ) -> None:
        super().__init__(sandbox_id, pid, offset, on_data)
        self._controller = controller
        self._stack = contextlib.ExitStack()
        self._ws: WebSocketSession = self._stack.enter_context(
            open_socket(controller, sandbox_id, pid, offset)
        )

    def __iter__(self) -> Iterator[bytes]:
        while (data := self.read()) is not None:
            yield data

    def read(self, timeout: float | None = None) -> bytes | None:
        """The next piece of output; None once the process exited.

        ``timeout``: seconds to wait, then ``b""`` when nothing came.
        """
        while not self.exited:
            try:
                event = self._ws.receive(timeout)
            except queue.Empty:
                return b""
            except WebSocketDisconnect as exc:
                raise self._closed(exc.code, exc.reason) from None
            except HTTPXWSException as exc:
                raise ControllerError(0, f"the terminal socket broke: {exc!r}") from exc
            data = self._frame(event)
            if data is not None:
                return data
        return None

    def wait(self) -> int | None:
        """Read (and hand to ``on_data``) the output until the process exits; its exit code."""
        for _ in self:
            pass
        return self.exit_code

    def send_stdin(self, data: str | bytes) -> None:
        """Keystrokes: ``data`` to the terminal (a str is sent as UTF-8)."""
        self._send(lambda: self._ws.send_bytes(data.encode() if isinstance(data, str) else data))

    def resize(self, cols: int, rows: int) -> None:
        """The terminal's new size; the process gets SIGWINCH."""
        message = resize_message(cols, rows)
        self._send(lambda: self._ws.send_text(message))

    def _send(self, sending: Callable[[], None]) -> None:
        try:
            sending()
        except (HTTPXWSException, WebSocketNetworkError, httpx.TransportError) as exc:
            raise ControllerError(0, f"the terminal socket broke: {exc!r}") from exc

    def kill(self) -> bool:
        """SIGKILL its process group; False when no such process is known."""
        try:
            self._controller.signal_process(self.sandbox_id, self.pid, "SIGKILL")
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def close(self) -> None:
        """Disconnect; the process runs on (see :meth:`kill`)."""
        self._stack.close()

    def __enter__(self) -> PtyHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pty:
    """``sandbox.pty``: terminals in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def create(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: str | list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        on_data: DataCallback | None = None,
        *,
        user: str | None = None,
    ) -> PtyHandle:
        """Start ``cmd`` (default: a login shell, bash where there is one) in a
        ``cols`` x ``rows`` terminal, and connect to it.

        ``timeout``: seconds until it is killed (exit code 124); none by
        default. ``on_data`` is called with each piece of output as it is read.
        ``user``: run as this user (default: the image's USER, else root).
        """
        sb = self._sandbox
        info = sb.controller.start_process(
            sb.id,
            LOGIN_SHELL if cmd is None else cmd,
            env=env,
            cwd=cwd,
            pty=(cols, rows),
            timeout_s=timeout,
            user=user,
        )
        return PtyHandle(sb.controller, sb.id, int(info["pid"]), 0, on_data)

    def connect(self, pid: int, offset: int = 0, on_data: DataCallback | None = None) -> PtyHandle:
        """The terminal of running process ``pid``, output from ``offset``.

        The default, 0, replays what the guest's ring still holds, which
        redraws a shell's screen; pass a handle's ``offset`` to resume.
        """
        return PtyHandle(self._sandbox.controller, self._sandbox.id, pid, offset, on_data)

    def kill(self, pid: int) -> bool:
        """SIGKILL process ``pid``; False when no such process is known."""
        try:
            self._sandbox.controller.signal_process(self._sandbox.id, pid, "SIGKILL")
        except ControllerError as exc:
            if exc.status == 404:
                return False
            raise
        return True
