"""The daemon's webhooks: endpoints added, listed, deleted and tested, and every event
the daemon publishes written to the outbox of each endpoint that takes it, as it is
published (the event bus calls :meth:`WebhookService.on_event`), then delivered by
:class:`.delivery.Deliverer`."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from forkd.controller.secret_box import SecretBox
from forkd.controller.services.events import EventBus, utc_stamp
from forkd.controller.store import Store
from forkd.controller.store_rows import walk_snapshots
from forkd.controller.webhooks import messages
from forkd.controller.webhooks.delivery import Deliverer
from forkd.controller.webhooks.destination import resolve
from forkd.controller.webhooks.tables import DeliveryRow, WebhookRow, WebhookTables
from forkd.errors import Invalid, NotFound

log = logging.getLogger(__name__)

MAX_WEBHOOKS = 64
MAX_PENDING = 100_000  # deliveries waiting for one endpoint; past it new ones are dropped
MAX_LINEAGE = 64  # snapshots named in a message's lineage, the template first


def _sealed_name(webhook_id: str) -> str:
    return f"webhook:{webhook_id}"


class WebhookService:
    def __init__(
        self, store: Store, box: SecretBox, events: EventBus, allow: tuple[str, ...]
    ) -> None:
        self.store = store
        self.box = box
        self.events = events
        self.allow = allow
        self.tables = WebhookTables(store)
        self._hooks = self.tables.all()  # read at each publish: kept in memory
        self._pending: dict[str, int] = {h.id: self.tables.pending_count(h.id) for h in self._hooks}
        self._count_lock = threading.Lock()  # publishers on any thread, attempts on others
        self.deliverer = Deliverer(self.tables, self._endpoint, self._ended, allow)
        events.add_listener(self.on_event)

    # ------------------------------------------------------------ endpoints

    async def add(
        self, url: str, events: list[str], secret: str | None, description: str
    ) -> tuple[WebhookRow, str | None]:
        """The endpoint, and its secret when the daemon made it (shown this once)."""
        url = messages.check_url(url)
        wanted = messages.check_events(events)
        made = None if secret is not None else messages.new_secret()
        secret = messages.check_secret(secret if secret is not None else made or "")
        if len(self._hooks) >= MAX_WEBHOOKS:
            raise Invalid(f"at most {MAX_WEBHOOKS} webhooks")
        await resolve(url, self.allow)  # refused now, not at its first delivery
        webhook_id = "wh_" + secrets.token_hex(8)
        row = WebhookRow(
            webhook_id,
            url,
            wanted,
            self.box.seal(_sealed_name(webhook_id), secret),
            description,
            time.time(),
        )
        self.tables.add(row)
        self._hooks = self.tables.all()
        with self._count_lock:
            self._pending[webhook_id] = 0
        return row, made

    def all(self) -> list[WebhookRow]:
        return list(self._hooks)

    def get(self, webhook_id: str) -> WebhookRow:
        found = self.tables.get(webhook_id)
        if found is None:
            raise NotFound(f"no webhook {webhook_id!r}")
        return found

    def delete(self, webhook_id: str) -> None:
        if not self.tables.delete(webhook_id):
            raise NotFound(f"no webhook {webhook_id!r}")
        self._hooks = self.tables.all()
        with self._count_lock:
            self._pending.pop(webhook_id, None)

    def deliveries(self, webhook_id: str, limit: int) -> list[DeliveryRow]:
        self.get(webhook_id)
        return self.tables.deliveries(webhook_id, limit)

    def pending(self, webhook_id: str) -> int:
        return self.tables.pending_count(webhook_id)

    def test(self, webhook_id: str) -> str:
        """A ``webhook.test`` message to that endpoint; its message id."""
        self.get(webhook_id)
        msg_id = "msg_test_" + secrets.token_hex(8)
        event = {"time": utc_stamp(), "webhook_id": webhook_id}
        body = messages.message(messages.TEST_EVENT, event, None)
        with self._count_lock:
            self.tables.enqueue([(msg_id, webhook_id, messages.TEST_EVENT, body)])
            self._pending[webhook_id] = self._pending.get(webhook_id, 0) + 1
        self.deliverer.wake()
        return msg_id

    # ------------------------------------------------------------ the outbox

    def on_event(self, event: dict[str, Any]) -> None:
        """An event published: written to each endpoint's outbox that takes it."""
        name = messages.WEBHOOK_EVENTS.get(str(event.get("type")))
        if name is None or not self._hooks:
            return
        hooks = [
            h
            for h in self._hooks
            if messages.wants(h.events, name) and event.get("webhook_id") != h.id
        ]
        if not hooks:
            return
        body = messages.message(name, event, self._sandbox(event.get("sandbox_id")))
        msg_id = f"msg_{event['id']}"
        with self._count_lock:
            rows = []
            for hook in hooks:
                if self._pending.get(hook.id, 0) >= MAX_PENDING:
                    log.warning("webhook %s: %d wait, %s dropped", hook.id, MAX_PENDING, msg_id)
                    continue
                rows.append((msg_id, hook.id, name, body))
            if rows:
                self.tables.enqueue(rows)
                for row in rows:  # counted once written
                    self._pending[row[1]] = self._pending.get(row[1], 0) + 1
        if rows:
            self.deliverer.wake()

    def _sandbox(self, sandbox_id: object) -> dict[str, Any] | None:
        if not isinstance(sandbox_id, str):
            return None
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            return None
        return {
            "id": row.id,
            "snapshot_tag": row.snapshot_tag,
            "metadata": row.metadata,
            "lineage": self._lineage(row.snapshot_tag),
        }

    def _lineage(self, tag: str) -> list[str]:
        """``tag`` and the snapshots it was branched from, the root template first (as
        far as they are still registered, at most :data:`MAX_LINEAGE` of them)."""
        row = self.store.get_snapshot(tag)
        if row is None:
            return [tag]
        up = walk_snapshots(row, self.store.get_snapshot, lambda r: r.parent_tag, MAX_LINEAGE - 1)
        return [*(t for t in up[::-1] if t != tag), tag]

    def _endpoint(self, webhook_id: str) -> tuple[str, str] | None:
        row = self.tables.get(webhook_id)
        if row is None:
            return None
        return row.url, self.box.open(_sealed_name(webhook_id), row.secret_sealed)

    def _ended(self, row: DeliveryRow, error: str | None) -> None:
        with self._count_lock:
            if row.webhook_id not in self._pending:
                return  # deleted meanwhile: nothing to count, nobody to tell
            self._pending[row.webhook_id] = max(0, self._pending[row.webhook_id] - 1)
        if error is None or row.event in (messages.FAILED_EVENT, messages.TEST_EVENT):
            return  # a failure about a failure is not told again: it would multiply
        self.events.publish(
            "webhook_failed",
            webhook_id=row.webhook_id,
            msg_id=row.msg_id,
            event=row.event,
            attempts=row.attempts + 1,
            error=error,
        )
