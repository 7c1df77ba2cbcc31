"""Host side of the guest agent channel (newline-delimited JSON, see docs/guest-agent.md).

One connection per VM over QEMU's unix socket for the virtio-serial port.
Requests carry ids, so many can be in flight; answers are matched by id and
anything else (a stale answer from before a snapshot, a broken line) is
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
from pathlib import Path
from typing import Any

from forkd.errors import AgentError

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024 * 1024  # largest answer accepted (file reads are base64)


class AgentClient:
    def __init__(self, sock_path: Path) -> None:
        self.sock_path = sock_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        # Random start: an answer to a request made before a snapshot may reach a
        # restored VM's new connection, and must not match a new request's id.
        self._ids = itertools.count(secrets.randbelow(1 << 40) + 1)
        self._read_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._closed_reason: str | None = None

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._closed_reason is None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to QEMU's socket for the port (it exists once QEMU started)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.sock_path), limit=MAX_LINE
                )
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise AgentError(f"cannot connect to {self.sock_path}: {exc}") from exc
                await asyncio.sleep(0.005)
        self._closed_reason = None
        self._read_task = asyncio.create_task(self._read_loop(), name="forkd-agent-reader")
        # A lone newline ends any partial line a snapshot may have left in the guest.
        self._writer.write(b"\n")
        await self._writer.drain()

    async def _read_loop(self) -> None:
        assert self._reader is not None
        reason = "agent connection closed"
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                    if msg.get("event") == "started":
                        self._fail_pending(
                            f"the guest agent restarted (pid {msg.get('pid')}); requests in "
                            "flight were lost (did code run by eval crash the interpreter?)"
                        )
                        continue
                    fut = self._pending.pop(int(msg["id"]), None)
                except (ValueError, KeyError, TypeError, AttributeError):
                    log.debug("dropping unparseable agent line %r", line[:200])
                    continue
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            reason = f"agent connection broken: {exc}"
        finally:
            self._closed_reason = reason
            self._fail_pending(reason)

    def _fail_pending(self, reason: str) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(AgentError(reason))
        self._pending.clear()

    async def call(
        self, op: str, params: dict[str, Any] | None = None, *, wait: float = 30.0
    ) -> dict[str, Any]:
        """Send one request and wait up to ``wait`` seconds for its ``result``."""
        if self._writer is None or self._closed_reason is not None:
            raise AgentError(self._closed_reason or "agent not connected")
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        data = json.dumps({**(params or {}), "id": req_id, "op": op}).encode() + b"\n"
        try:
            async with self._write_lock:
                self._writer.write(data)
                await self._writer.drain()
            msg = await asyncio.wait_for(fut, wait)
        except TimeoutError as exc:
            raise AgentError(f"agent did not answer {op!r} within {wait:g} s") from exc
        except ConnectionError as exc:
            raise AgentError(f"agent connection broken: {exc}") from exc
        finally:
            self._pending.pop(req_id, None)
        if not msg.get("ok"):
            raise AgentError(str(msg.get("error") or f"agent {op} failed"), kind=msg.get("kind"))
        return msg.get("result") or {}

    async def close(self) -> None:
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._read_task
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        self._writer = None
        self._reader = None
        self._closed_reason = "closed"
