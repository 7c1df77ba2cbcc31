"""Deliveries of the outbox, at least once: each endpoint's deliveries in order, one at a
time, :data:`MAX_IN_FLIGHT` endpoints at once, so a slow or dead endpoint delays only its
own. An attempt is a POST signed as Standard Webhooks signs (``webhook-id``,
``webhook-timestamp``, ``webhook-signature``: HMAC-SHA256 of ``id.timestamp.body``, by
the ``standardwebhooks`` library), to the checked address (:mod:`.destination`), with
no redirect followed and at most :data:`MAX_ANSWER_BYTES` of the answer read. A 2xx
answer delivers it; anything else is tried again with exponential backoff and jitter
for :data:`RETRY_FOR_SECS`, then the delivery fails and a ``webhook_failed`` event
says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from standardwebhooks import Webhook

from forkd.controller.webhooks.destination import resolve
from forkd.controller.webhooks.tables import DeliveryRow, WebhookTables
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 16  # endpoints delivered to at once
ATTEMPT_SECS = 10.0  # one attempt, connect to answer
MAX_ANSWER_BYTES = 4096  # of an answer, read (the rest is dropped)
FIRST_RETRY_SECS = 5.0  # then doubled each attempt, at most MAX_RETRY_SECS, +-25%
MAX_RETRY_SECS = 3600.0
RETRY_FOR_SECS = 24 * 3600.0  # then the delivery fails
IDLE_SECS = 5.0  # the loop looks again at least this often
STOP_SECS = 10.0  # the deliveries' thread, once told to stop: attempts are cut off

# (webhook id, its URL, its secret) of an endpoint, or None once it is deleted.
Endpoint = Callable[[str], tuple[str, str] | None]
# (the delivery, why it failed: None when it was delivered): told once it is no longer
# pending.
Ended = Callable[[DeliveryRow, str | None], None]


def retry_delay(attempts: int) -> float:
    """The wait after the ``attempts``-th failed attempt."""
    base = min(FIRST_RETRY_SECS * 2.0 ** max(0, attempts - 1), MAX_RETRY_SECS)
    return float(base * random.uniform(0.75, 1.25))


class Deliverer:
    def __init__(
        self, tables: WebhookTables, endpoint: Endpoint, ended: Ended, allow: tuple[str, ...]
    ) -> None:
        self.tables = tables
        self.endpoint = endpoint
        self.ended = ended
        self.allow = allow
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._sending: dict[str, asyncio.Task[None]] = {}  # webhook id -> its attempt
        self._held: dict[str, float] = {}  # webhook id -> not before (its record failed)

    def start(self) -> None:
        """Deliveries run in a thread of their own, on an event loop of their own: what
        they cost (connections, signing, their records) never takes a turn of the
        API's loop, so a burst of them delays no request."""
        started = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(started),), name="forkd-webhooks", daemon=True
        )
        self._thread.start()
        started.wait(5)

    async def _main(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._run()

    async def stop(self) -> None:
        loop, task, thread = self._loop, self._task, self._thread
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                loop.call_soon_threadsafe(task.cancel)
        if thread is not None:
            await asyncio.to_thread(thread.join, STOP_SECS)

    def wake(self) -> None:
        """New deliveries were written (from any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)  # no connection carries two names
        async with httpx.AsyncClient(
            follow_redirects=False, timeout=ATTEMPT_SECS, trust_env=False, limits=limits
        ) as client:
            try:
                while True:
                    self._wake.clear()
                    try:
                        wait = await self._round(client)
                    except Exception:  # the store failed: logged, and tried again soon
                        log.exception("webhook deliveries: a round failed")
                        wait = IDLE_SECS
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), max(wait, 0.05))
            finally:  # the attempts under way end before their client closes
                for task in list(self._sending.values()):
                    task.cancel()
                await asyncio.gather(*self._sending.values(), return_exceptions=True)

    async def _round(self, client: httpx.AsyncClient) -> float:
        """Start the attempts that are due; how long until the next one is."""
        now = time.time()
        soonest = now + IDLE_SECS
        for row in await asyncio.to_thread(self.tables.heads):
            if row.webhook_id in self._sending:
                continue  # its attempt is under way: the next is timed by its end
            due = max(row.next_at_unix, self._held.get(row.webhook_id, 0.0))
            if due > now or len(self._sending) >= MAX_IN_FLIGHT:
                soonest = min(soonest, due) if due > now else soonest
                continue
            task = asyncio.create_task(self._attempt(client, row))
            self._sending[row.webhook_id] = task
            task.add_done_callback(functools.partial(self._done, row.webhook_id))
        return max(0.0, soonest - time.time())

    def _done(self, webhook_id: str, _task: asyncio.Task[None]) -> None:
        self._sending.pop(webhook_id, None)
        self._wake.set()

    async def _attempt(self, client: httpx.AsyncClient, row: DeliveryRow) -> None:
        started = time.monotonic()
        code: int | None = None
        try:
            async with asyncio.timeout(ATTEMPT_SECS):  # the whole attempt, however it trickles
                code = await self._send(client, row)
            error = None if 200 <= code < 300 else f"answered {code}"
        except TimeoutError:
            error = f"no answer within {ATTEMPT_SECS:g} s"
        except (httpx.HTTPError, ForkdError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the delivery is tried again, never lost
            log.exception("webhook delivery %s failed", row.msg_id)
            error = f"internal error: {type(exc).__name__}"
        latency = (time.monotonic() - started) * 1000
        try:
            await asyncio.to_thread(self._record, row, code, error, latency)
        except Exception:  # the store failed: this endpoint waits, then it is tried again
            log.exception("webhook delivery %s: its attempt could not be recorded", row.msg_id)
            self._held[row.webhook_id] = time.time() + IDLE_SECS

    def _record(self, row: DeliveryRow, code: int | None, error: str | None, ms: float) -> None:
        if error is None:
            status, next_at = "delivered", time.time()
        else:
            next_at = time.time() + retry_delay(row.attempts + 1)
            over = next_at > row.created_at_unix + RETRY_FOR_SECS
            status = "failed" if over else "pending"
        self.tables.attempted(
            row.seq, status=status, code=code, error=error, latency_ms=ms, next_at=next_at
        )
        if status != "pending":
            self.ended(row, error)

    async def _send(self, client: httpx.AsyncClient, row: DeliveryRow) -> int:
        """One attempt: the answer's status (its body read up to MAX_ANSWER_BYTES)."""
        found = await asyncio.to_thread(self.endpoint, row.webhook_id)
        if found is None:
            raise ForkdError("the webhook was deleted")
        url, secret = found
        where = await resolve(url, self.allow)
        now = datetime.now(UTC)
        headers = {
            "content-type": "application/json",
            "host": where.host,
            "user-agent": "forkd-webhooks",
            "webhook-id": row.msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(row.msg_id, now, row.body),
        }
        extensions = {"sni_hostname": where.sni} if where.sni else {}
        request = client.build_request(
            "POST", where.url, content=row.body.encode(), headers=headers, extensions=extensions
        )
        response = await client.send(request, stream=True)
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= MAX_ANSWER_BYTES:
                    break
        finally:
            await response.aclose()
        return response.status_code
