"""The webhooks' tables in the daemon's SQLite store: each endpoint (its URL, the events
it takes, its secret sealed), and the outbox of deliveries, one row per event per
endpoint, kept until it is delivered or given up (then kept a while for
``GET /v1/webhooks/{id}/deliveries``).

A delivery row is written when its event is published, before anything is sent: a
daemon that dies before sending finds it pending at its next start and sends it then.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from forkd.controller.store import Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS webhooks (
    id              TEXT PRIMARY KEY,
    url             TEXT NOT NULL,
    events          TEXT NOT NULL,
    secret_sealed   BLOB NOT NULL,
    description     TEXT NOT NULL DEFAULT '',
    created_at_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    msg_id          TEXT NOT NULL,
    webhook_id      TEXT NOT NULL,
    event           TEXT NOT NULL,
    body            TEXT NOT NULL,
    created_at_unix REAL NOT NULL,
    status          TEXT NOT NULL DEFAULT 'pending',
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_at_unix    REAL NOT NULL,
    last_status     INTEGER,
    last_error      TEXT,
    last_latency_ms REAL,
    ended_at_unix   REAL
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due
    ON webhook_deliveries (status, webhook_id, seq);
CREATE INDEX IF NOT EXISTS webhook_deliveries_ended
    ON webhook_deliveries (ended_at_unix);
"""
KEEP_ENDED_SECS = 7 * 24 * 3600.0  # a delivered or failed row is listed this long
PRUNE_EVERY_SECS = 600.0


@dataclass(frozen=True)
class WebhookRow:
    id: str
    url: str
    events: tuple[str, ...]
    secret_sealed: bytes
    description: str
    created_at_unix: float


@dataclass(frozen=True)
class DeliveryRow:
    seq: int
    msg_id: str
    webhook_id: str
    event: str
    body: str
    created_at_unix: float
    status: str  # pending | delivered | failed
    attempts: int
    next_at_unix: float
    last_status: int | None
    last_error: str | None
    last_latency_ms: float | None
    ended_at_unix: float | None


def _webhook(row: Any) -> WebhookRow:
    return WebhookRow(
        row["id"],
        row["url"],
        tuple(json.loads(row["events"])),
        bytes(row["secret_sealed"]),
        row["description"],
        row["created_at_unix"],
    )


class WebhookTables:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._next_prune = 0.0
        with store.transaction() as db:
            for statement in filter(str.strip, SCHEMA.split(";")):
                db.execute(statement)

    # ------------------------------------------------------------ endpoints

    def add(self, row: WebhookRow) -> None:
        with self.store.transaction() as db:
            db.execute(
                "INSERT INTO webhooks VALUES (?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.url,
                    json.dumps(list(row.events)),
                    row.secret_sealed,
                    row.description,
                    row.created_at_unix,
                ),
            )

    def all(self) -> list[WebhookRow]:
        return [_webhook(r) for r in self.store.query("SELECT * FROM webhooks ORDER BY id")]

    def get(self, webhook_id: str) -> WebhookRow | None:
        found = self.store.query("SELECT * FROM webhooks WHERE id = ?", (webhook_id,))
        return _webhook(found[0]) if found else None

    def delete(self, webhook_id: str) -> bool:
        """The endpoint and every delivery to it; whether there was one."""
        with self.store.transaction() as db:
            db.execute("DELETE FROM webhook_deliveries WHERE webhook_id = ?", (webhook_id,))
            return db.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,)).rowcount > 0

    # ------------------------------------------------------------ the outbox

    def enqueue(self, deliveries: list[tuple[str, str, str, str]]) -> None:
        """(msg id, webhook id, event, body) rows, pending from now, in one transaction."""
        now = time.time()
        with self.store.transaction() as db:
            db.executemany(
                "INSERT INTO webhook_deliveries "
                "(msg_id, webhook_id, event, body, created_at_unix, next_at_unix) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(*d, now, now) for d in deliveries],
            )

    def heads(self) -> list[DeliveryRow]:
        """Each endpoint's oldest pending delivery: deliveries to one endpoint go out in
        order, one at a time."""
        rows = self.store.query(
            "SELECT d.* FROM webhook_deliveries d JOIN ("
            " SELECT webhook_id, MIN(seq) AS seq FROM webhook_deliveries"
            " WHERE status = 'pending' GROUP BY webhook_id"
            ") h ON d.seq = h.seq"
        )
        return [DeliveryRow(**dict(r)) for r in rows]

    def attempted(
        self,
        seq: int,
        *,
        status: str,
        code: int | None,
        error: str | None,
        latency_ms: float | None,
        next_at: float,
    ) -> None:
        ended = time.time() if status != "pending" else None
        with self.store.transaction() as db:
            db.execute(
                "UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1, "
                "last_status = ?, last_error = ?, last_latency_ms = ?, next_at_unix = ?, "
                "ended_at_unix = ? WHERE seq = ?",
                (status, code, error, latency_ms, next_at, ended, seq),
            )
        if time.monotonic() >= self._next_prune:  # now and then, not at every attempt
            self._next_prune = time.monotonic() + PRUNE_EVERY_SECS
            with self.store.transaction() as db:
                db.execute(
                    "DELETE FROM webhook_deliveries WHERE ended_at_unix < ?",
                    (time.time() - KEEP_ENDED_SECS,),
                )

    def deliveries(self, webhook_id: str, limit: int) -> list[DeliveryRow]:
        rows = self.store.query(
            "SELECT * FROM webhook_deliveries WHERE webhook_id = ? ORDER BY seq DESC LIMIT ?",
            (webhook_id, limit),
        )
        return [DeliveryRow(**dict(r)) for r in rows]

    def pending_count(self, webhook_id: str) -> int:
        found = self.store.query(
            "SELECT COUNT(*) AS n FROM webhook_deliveries WHERE webhook_id = ? AND "
            "status = 'pending'",
            (webhook_id,),
        )
        return int(found[0]["n"])
