"""The daemon's state in SQLite (WAL): snapshots, sandboxes, branch sequence numbers.

Every write is one transaction. The database is the registry; the snapshot
directories on disk are the data. The daemon's start
(:meth:`forkd.controller.services.lifecycle.Lifecycle.start`: its
``reconcile_snapshots``, ``adopt_sandboxes`` and ``kill_strays``) brings the two
back in line after a crash.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar, Unpack

from forkd.controller.store_rows import (
    ADDED_COLUMNS,
    SCHEMA,
    SandboxChanges,
    SandboxRow,
    SecretRow,
    SnapshotChanges,
    SnapshotRow,
    WorkspaceChanges,
    WorkspaceRow,
    merged_labels,
)
from forkd.errors import Conflict, Invalid, NotFound
from forkd.states import (
    SANDBOX_MOVES,
    SNAPSHOT_MOVES,
    OnTimeout,
    SandboxState,
    SnapshotMode,
    SnapshotStatus,
    check_move,
)


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        # Re-entrant: an event published inside a transaction writes its webhook outbox
        # rows in that same transaction (forkd.controller.services.events.EventBus.guard).
        self._lock = threading.RLock()
        self._depth = 0  # transactions open on the thread holding the lock
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(SCHEMA)
            self._migrate()
        self.id_prefix = self._meta_default("id_prefix", secrets.token_hex(3))

    def _migrate(self) -> None:
        """Columns added after the first release of the schema."""
        for table, columns in ADDED_COLUMNS.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        # A background branch was 'pending' before it took the original forkd's name.
        self._db.execute("UPDATE snapshots SET status = 'writing' WHERE status = 'pending'")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def lock(self) -> threading.RLock:
        """Held by every read and write of the database; whoever holds it may open
        transactions of its own inside (they nest)."""
        return self._lock

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed on success, rolled back on any error.
        Opened inside another one (on the same thread), it is a savepoint of it: its
        changes are undone alone if it fails, and committed only with the outer one."""
        with self._lock:
            nested = self._depth > 0
            self._db.execute("SAVEPOINT nested" if nested else "BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield self._db
            except BaseException:
                if nested:
                    self._db.execute("ROLLBACK TO nested")
                    self._db.execute("RELEASE nested")
                else:
                    self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("RELEASE nested" if nested else "COMMIT")
            finally:
                self._depth -= 1

    # For the tables of other rooms (forkd.controller.webhooks): one write transaction,
    # and a read, on this database.
    transaction = _transaction

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._query(sql, args)

    def _tx(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._transaction() as db:
            return db.execute(sql, args)

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    @staticmethod
    def _update(
        db: sqlite3.Connection,
        table: str,
        key: str,
        value: str,
        changes: dict[str, Any],
        state: str | None = None,
    ) -> None:
        """``UPDATE table SET ... WHERE key = value``. The column names are the keys of
        ``table``'s ``*Changes`` type (checked by the type checker, and here), and
        ``state`` only when the caller is the one that checked its move."""
        allowed = _CHANGEABLE[table] | ({state} if state else set())
        for name in changes:
            if name not in allowed:
                raise ValueError(f"{table} has no changeable column {name!r}")
        if changes:
            cols = ", ".join(f"{name} = ?" for name in changes)
            db.execute(f"UPDATE {table} SET {cols} WHERE {key} = ?", (*changes.values(), value))

    def _meta_default(self, key: str, value: str) -> str:
        self._tx("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", (key, value))
        return str(self._query("SELECT value FROM meta WHERE key = ?", (key,))[0]["value"])

    # ---------------------------------------------------------- sequences

    def next_sandbox_id(self) -> str:
        """``sb-<daemon prefix>-<seq>``; the sequence survives restarts."""
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('sb_seq', '0')")
            db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'sb_seq'")
            seq = int(db.execute("SELECT value FROM meta WHERE key = 'sb_seq'").fetchone()[0])
        return f"sb-{self.id_prefix}-{seq:04d}"

    def next_branch_seq(self, source_id: str) -> int:
        """Monotonic per source sandbox, persisted: a restart never reuses a number."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO branch_seq(source_id, seq) VALUES (?, 1) "
                "ON CONFLICT(source_id) DO UPDATE SET seq = seq + 1",
                (source_id,),
            )
            row = db.execute("SELECT seq FROM branch_seq WHERE source_id = ?", (source_id,))
            return int(row.fetchone()[0])

    def count_branch(self, source_id: str) -> None:
        """One more branch taken of sandbox ``source_id`` (SandboxInfo's branch_count)."""
        self._tx(
            "INSERT INTO branch_counts(source_id, branches) VALUES (?, 1) "
            "ON CONFLICT(source_id) DO UPDATE SET branches = branches + 1",
            (source_id,),
        )

    def branch_counts(self) -> dict[str, int]:
        """Branches taken, per sandbox that has any."""
        rows = self._query("SELECT source_id, branches FROM branch_counts")
        return {str(row[0]): int(row[1]) for row in rows}

    # ---------------------------------------------------------- secrets

    def add_secret(self, row: SecretRow, cap: int) -> None:
        """Insert ``row``: :class:`Conflict` if the name is taken, :class:`Invalid` when
        ``cap`` secrets exist (both checked in the insert's transaction)."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM secrets WHERE name = ?", (row.name,)).fetchone():
                raise Conflict(
                    f"secret {row.name!r} exists: PUT /v1/secrets/{row.name} "
                    "changes its value or hosts"
                )
            if db.execute("SELECT COUNT(*) FROM secrets").fetchone()[0] >= cap:
                raise Invalid(f"this daemon holds {cap} secrets, its most: delete one first")
            db.execute(
                "INSERT INTO secrets(name, sealed, hosts, created_at_unix, updated_at_unix, "
                "last_used_unix) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    row.name,
                    row.sealed,
                    json.dumps(row.hosts),
                    row.created_at_unix,
                    row.updated_at_unix,
                    row.last_used_unix,
                ),
            )

    def replace_secret(
        self, name: str, updated_at_unix: float, sealed: bytes | None, hosts: list[str] | None
    ) -> SecretRow:
        """A new value and/or hosts for ``name``, in one transaction; :class:`NotFound`."""
        with self._transaction() as db:
            if sealed is not None:
                db.execute("UPDATE secrets SET sealed = ? WHERE name = ?", (sealed, name))
            if hosts is not None:
                db.execute("UPDATE secrets SET hosts = ? WHERE name = ?", (json.dumps(hosts), name))
            cur = db.execute(
                "UPDATE secrets SET updated_at_unix = ? WHERE name = ?", (updated_at_unix, name)
            )
            if cur.rowcount == 0:
                raise NotFound(f"no secret {name!r}")
            found = db.execute("SELECT * FROM secrets WHERE name = ?", (name,)).fetchone()
        return _secret(found)

    def get_secret(self, name: str) -> SecretRow | None:
        rows = self._query("SELECT * FROM secrets WHERE name = ?", (name,))
        return _secret(rows[0]) if rows else None

    def list_secrets(self) -> list[SecretRow]:
        return [_secret(r) for r in self._query("SELECT * FROM secrets ORDER BY name")]

    def delete_secret(self, name: str) -> bool:
        return self._tx("DELETE FROM secrets WHERE name = ?", (name,)).rowcount > 0

    def mark_secrets_used(self, used: Mapping[str, float]) -> None:
        """Each secret's last use (never moved back), in one transaction."""
        with self._transaction() as db:
            db.executemany(
                "UPDATE secrets SET last_used_unix = MAX(COALESCE(last_used_unix, 0), ?) "
                "WHERE name = ?",
                [(when, name) for name, when in used.items()],
            )

    # ---------------------------------------------------------- snapshots

    def add_snapshot(self, row: SnapshotRow, replace: bool = False) -> None:
        """Register a snapshot; raises sqlite3.IntegrityError if the tag exists, unless
        ``replace`` (a pending branch settling, a compacted snapshot: one transaction),
        and then only along the status table."""
        with self._transaction() as db:
            if replace:
                self._snapshot_moves(db, row.tag, row.status)
            self._insert_snapshot(db, row, replace)

    @staticmethod
    def _insert_snapshot(db: sqlite3.Connection, row: SnapshotRow, replace: bool) -> None:
        db.execute(
            f"INSERT {'OR REPLACE ' if replace else ''}INTO snapshots(tag, dir, "
            "created_at_unix, branched_from, pause_ms, parent_tag, image, memory_mib, status, "
            "metadata, mode, base_tag, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.tag,
                row.dir,
                row.created_at_unix,
                row.branched_from,
                row.pause_ms,
                row.parent_tag,
                row.image,
                row.memory_mib,
                row.status,
                json.dumps(row.metadata),
                row.mode,
                row.base_tag,
                row.error,
            ),
        )

    def update_snapshot(self, tag: str, **changes: Unpack[SnapshotChanges]) -> None:
        with self._transaction() as db:
            self._update(db, "snapshots", "tag", tag, dict(changes))

    def set_snapshot_status(
        self, tag: str, status: SnapshotStatus, **changes: Unpack[SnapshotChanges]
    ) -> None:
        """Move snapshot ``tag`` to ``status`` (and change ``changes`` with it), in one
        transaction; :class:`~forkd.states.IllegalTransition` when its table forbids it."""
        with self._transaction() as db:
            if self._snapshot_moves(db, tag, status) is None:
                raise NotFound(f"snapshot {tag!r} not found")
            self._update(db, "snapshots", "tag", tag, {"status": status, **changes}, "status")

    @staticmethod
    def _snapshot_moves(
        db: sqlite3.Connection, tag: str, status: SnapshotStatus
    ) -> SnapshotStatus | None:
        """Snapshot ``tag``'s status, checked to move to ``status``; None: no such row."""
        found = db.execute("SELECT status FROM snapshots WHERE tag = ?", (tag,)).fetchone()
        return _checked(f"snapshot {tag!r}", SNAPSHOT_MOVES, found, status)

    def get_snapshot(self, tag: str) -> SnapshotRow | None:
        rows = self._query("SELECT * FROM snapshots WHERE tag = ?", (tag,))
        return SnapshotRow(**_fields(rows[0])) if rows else None

    def list_snapshots(self) -> list[SnapshotRow]:
        rows = self._query("SELECT * FROM snapshots ORDER BY created_at_unix, tag")
        return [SnapshotRow(**_fields(r)) for r in rows]

    def delete_snapshot(self, tag: str) -> bool:
        return self._tx("DELETE FROM snapshots WHERE tag = ?", (tag,)).rowcount > 0

    # ---------------------------------------------------------- registries

    def record_digest(self, snapshot_id: str, repository: str, digest: str) -> None:
        """Snapshot ``snapshot_id`` is manifest ``digest`` in ``repository`` (pushed or pulled)."""
        self._tx(
            "INSERT OR REPLACE INTO registry_digests(snapshot_id, repository, digest) "
            "VALUES (?, ?, ?)",
            (snapshot_id, repository, digest),
        )

    def digests_of(self, snapshot_id: str) -> list[str]:
        """The manifest digests snapshot ``snapshot_id`` is known by, in any repository."""
        rows = self._query(
            "SELECT DISTINCT digest FROM registry_digests WHERE snapshot_id = ?", (snapshot_id,)
        )
        return [str(r[0]) for r in rows]

    def snapshots_of_digest(self, digest: str) -> list[str]:
        """The ids of the snapshots known as manifest ``digest`` (content-addressed: the
        same in every repository)."""
        rows = self._query(
            "SELECT DISTINCT snapshot_id FROM registry_digests WHERE digest = ?", (digest,)
        )
        return [str(r[0]) for r in rows]

    # ---------------------------------------------------------- sandboxes

    def add_sandbox(self, row: SandboxRow) -> None:
        self._tx(
            "INSERT INTO sandboxes(id, snapshot_tag, run_dir, pid, created_at_unix, "
            "memory_limit_mib, expires_at_unix, state, metadata, on_timeout, idle_timeout_s, "
            "seed, auto_resume, evictable) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.snapshot_tag,
                row.run_dir,
                row.pid,
                row.created_at_unix,
                row.memory_limit_mib,
                row.expires_at_unix,
                row.state,
                json.dumps(row.metadata),
                row.on_timeout,
                row.idle_timeout_s,
                row.seed,
                int(row.auto_resume),
                int(row.evictable),
            ),
        )

    def update_sandbox(self, sandbox_id: str, **changes: Unpack[SandboxChanges]) -> None:
        with self._transaction() as db:
            self._update(db, "sandboxes", "id", sandbox_id, dict(changes))

    def add_sandbox_labels(self, sandbox_id: str, labels: dict[str, str]) -> dict[str, str]:
        """Merge ``labels`` over sandbox ``sandbox_id``'s, in one transaction; its labels
        now. :class:`NotFound` when there is no such sandbox, :class:`Invalid` past the cap."""
        with self._transaction() as db:
            found = db.execute("SELECT metadata FROM sandboxes WHERE id = ?", (sandbox_id,))
            row = found.fetchone()
            if row is None:
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            merged = merged_labels(json.loads(row[0] or "{}"), labels)
            db.execute(
                "UPDATE sandboxes SET metadata = ? WHERE id = ?", (json.dumps(merged), sandbox_id)
            )
        return merged

    def set_sandbox_state(
        self, sandbox_id: str, state: SandboxState, **changes: Unpack[SandboxChanges]
    ) -> SandboxState:
        """Move sandbox ``sandbox_id`` to ``state`` (and change ``changes`` with it), in
        one transaction; :class:`~forkd.states.IllegalTransition` when its table forbids
        it. The state it was in."""
        with self._transaction() as db:
            found = db.execute("SELECT state FROM sandboxes WHERE id = ?", (sandbox_id,))
            was = _checked(f"sandbox {sandbox_id!r}", SANDBOX_MOVES, found.fetchone(), state)
            if was is None:
                raise NotFound(f"sandbox {sandbox_id!r} not found")
            self._update(db, "sandboxes", "id", sandbox_id, {"state": state, **changes}, "state")
        return was

    def get_sandbox(self, sandbox_id: str) -> SandboxRow | None:
        rows = self._query("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return SandboxRow(**_fields(rows[0])) if rows else None

    def list_sandboxes(self) -> list[SandboxRow]:
        rows = self._query("SELECT * FROM sandboxes ORDER BY created_at_unix, id")
        return [SandboxRow(**_fields(r)) for r in rows]

    def delete_sandbox(self, sandbox_id: str) -> bool:
        """Its row and its branch count, in one transaction; False if it had no row."""
        with self._transaction() as db:
            db.execute("DELETE FROM branch_counts WHERE source_id = ?", (sandbox_id,))
            return db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,)).rowcount > 0

    # ---------------------------------------------------------- workspaces

    def add_workspace(self, row: WorkspaceRow) -> None:
        self._tx(
            "INSERT INTO workspaces(name, id, source_snapshot_tag, sandbox_id, created_at_unix, "
            "last_active_unix, per_child_netns, memory_limit_mib) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.name,
                row.id,
                row.source_snapshot_tag,
                row.sandbox_id,
                row.created_at_unix,
                row.last_active_unix,
                int(row.per_child_netns),
                row.memory_limit_mib,
            ),
        )

    def update_workspace(self, name: str, **changes: Unpack[WorkspaceChanges]) -> None:
        with self._transaction() as db:
            self._update(db, "workspaces", "name", name, dict(changes))

    def get_workspace(self, name: str) -> WorkspaceRow | None:
        rows = self._query("SELECT * FROM workspaces WHERE name = ?", (name,))
        return _workspace(rows[0]) if rows else None

    def list_workspaces(self) -> list[WorkspaceRow]:
        return [_workspace(r) for r in self._query("SELECT * FROM workspaces ORDER BY name")]

    def delete_workspace(self, name: str) -> bool:
        return self._tx("DELETE FROM workspaces WHERE name = ?", (name,)).rowcount > 0


S = TypeVar("S", SandboxState, SnapshotStatus)


def _checked(
    what: str, moves: Mapping[S, frozenset[S]], found: sqlite3.Row | None, new: S
) -> S | None:
    """The state a row was read in (``found``: its one column), checked by ``moves`` to
    become ``new``; None when there is no such row."""
    if found is None:
        return None
    old = type(new)(found[0])
    check_move(what, moves, old, new)
    return old


def _secret(row: sqlite3.Row) -> SecretRow:
    return SecretRow(
        name=row["name"],
        sealed=bytes(row["sealed"]),
        hosts=json.loads(row["hosts"]),
        created_at_unix=row["created_at_unix"],
        updated_at_unix=row["updated_at_unix"],
        last_used_unix=row["last_used_unix"],
    )


def _workspace(row: sqlite3.Row) -> WorkspaceRow:
    fields = dict(row)
    fields["per_child_netns"] = bool(fields["per_child_netns"])
    return WorkspaceRow(**fields)


def _fields(row: sqlite3.Row) -> dict[str, Any]:
    """A row's columns as its dataclass takes them (``metadata`` is stored as JSON, the
    states as their words)."""
    fields = dict(row)
    fields["metadata"] = json.loads(fields.get("metadata") or "{}")
    for flag in ("auto_resume", "evictable"):
        if flag in fields:
            fields[flag] = bool(fields[flag])
    for column, kind in _STATE_COLUMNS.items():
        if column in fields:
            fields[column] = kind(fields[column])
    return fields


_STATE_COLUMNS: dict[str, type[StrEnum]] = {
    "state": SandboxState,
    "on_timeout": OnTimeout,
    "status": SnapshotStatus,
    "mode": SnapshotMode,
}

# The only column names an UPDATE is ever built from.
_CHANGEABLE: dict[str, frozenset[str]] = {
    "snapshots": SnapshotChanges.__optional_keys__,
    "sandboxes": SandboxChanges.__optional_keys__,
    "workspaces": WorkspaceChanges.__optional_keys__,
}
