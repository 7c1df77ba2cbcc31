"""The terminal route: ``GET /v1/sandboxes/{id}/processes/{pid}/pty`` as a WebSocket.

Frames (docs/API.md, "Terminals"): binary from the server is the terminal's
output, binary from the client is keystrokes; text frames are JSON control
messages: ``resize`` from the client; ``gap``, ``error`` and, last, ``exit``
from the server, which then closes with 1000. A refusal before the
handshake is the HTTP error any route would answer. OpenAPI does not
describe WebSockets, so this route is absent from docs/openapi.json.

Output is sent one piece at a time and the next is pulled from the guest
only once the send returned; uvicorn's send waits while the socket's write
buffer is full, so a client that does not read stops the pulling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnected

from forkd.controller.http_errors import close_reason, refuse_websocket, status_of
from forkd.controller.models import ProcessResize
from forkd.controller.services.terminals import (
    TerminalBytes,
    TerminalExit,
    TerminalGap,
    TerminalPiece,
    TerminalService,
)
from forkd.errors import Conflict, ForkdError

PTY_PATH = "/v1/sandboxes/{sandbox_id}/processes/{pid}/pty"
CLOSE_NORMAL = 1000
APP_CLOSE_BASE = 4000  # a failure after the handshake closes with 4000 + its HTTP status

# What sending raises once the client is gone (uvicorn's ClientDisconnected is an OSError).
_GONE = (WebSocketDisconnect, WebSocketDisconnected, OSError)

router = APIRouter(tags=["processes"])


@router.websocket(PTY_PATH)
async def pty_socket(
    websocket: WebSocket,
    sandbox_id: str,
    pid: Annotated[int, Path(ge=1)],
    offset: Annotated[int, Query(ge=0)] = 0,
) -> None:
    """The process's terminal; output from ``offset`` (default 0: all the ring holds)."""
    terminal = TerminalService(websocket.app.state.services.processes)
    try:
        output = await terminal.open(sandbox_id, pid, offset)
    except ForkdError as exc:
        await refuse_websocket(
            websocket.scope, websocket.receive, websocket.send, status_of(exc), str(exc)
        )
        return
    await websocket.accept()
    session = _Session(websocket, terminal, sandbox_id, pid)
    await session.run(output)


class _Session:
    """One accepted terminal socket: output out and keystrokes in, until either ends."""

    def __init__(
        self, websocket: WebSocket, terminal: TerminalService, sandbox_id: str, pid: int
    ) -> None:
        self.websocket = websocket
        self.terminal = terminal
        self.sandbox_id = sandbox_id
        self.pid = pid

    async def run(self, output: AsyncIterator[TerminalPiece]) -> None:
        sending = asyncio.create_task(self._send_output(output))
        receiving = asyncio.create_task(self._receive_input())
        done, pending = await asyncio.wait(
            {sending, receiving}, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in done:
            task.result()  # a bug surfaces here, for the audit middleware's 500 close

    async def _send_output(self, output: AsyncIterator[TerminalPiece]) -> None:
        """Output until the exit; a guest failure closes with 4000 + its status."""
        try:
            async for piece in output:
                await self._send_piece(piece)
        except ForkdError as exc:
            await self._close(APP_CLOSE_BASE + status_of(exc), str(exc))
        except _GONE:  # the client left while we sent
            return
        else:
            await self._close(CLOSE_NORMAL, "the process exited")

    async def _send_piece(self, piece: TerminalPiece) -> None:
        ws = self.websocket
        if isinstance(piece, TerminalBytes):
            await ws.send_bytes(piece.data)
        elif isinstance(piece, TerminalGap):
            await ws.send_text(
                json.dumps({"type": "gap", "from": piece.lost_from, "to": piece.lost_to})
            )
        elif isinstance(piece, TerminalExit):
            await ws.send_text(json.dumps({"type": "exit", "exit_code": piece.exit_code}))

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*_GONE):  # gone already
            await self.websocket.close(code, close_reason(reason))

    async def _receive_input(self) -> None:
        """Keystrokes and resizes until the client leaves."""
        ws = self.websocket
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data: bytes | None = message.get("bytes")
            text: str | None = message.get("text")
            try:
                if data is not None:
                    await self.terminal.write(self.sandbox_id, self.pid, data)
                elif text is not None:
                    await self._control(text)
            except Conflict:
                pass  # input to a process that exited: its exit frame is on the way
            except ForkdError as exc:
                await self._send_error(str(exc), status_of(exc))

    async def _control(self, text: str) -> None:
        try:
            resize = ProcessResize.model_validate(_control_message(text))
        except (ValueError, ValidationError) as exc:
            await self._send_error(
                f'a text frame must be {{"type": "resize", "cols": N, '
                f'"rows": N}} with 1 <= N <= 1000: {exc}',
                400,
            )
            return
        await self.terminal.resize(self.sandbox_id, self.pid, resize.cols, resize.rows)

    async def _send_error(self, message: str, status: int) -> None:
        """A bad control message or a failed write: said, and the session goes on."""
        frame = {"type": "error", "error": message, "status": status}
        with contextlib.suppress(*_GONE):
            await self.websocket.send_text(json.dumps(frame))


def _control_message(text: str) -> dict[str, Any]:
    """The fields of a ``resize`` message; ValueError for anything else."""
    message = json.loads(text)
    if not isinstance(message, dict) or message.get("type") != "resize":
        raise ValueError("not a resize message")
    return {k: v for k, v in message.items() if k != "type"}
