"""The daemon's tables (:data:`SCHEMA`) and their records as the store reads and writes
them: one dataclass per table, the columns each ``update_*`` may change, and the small
rules of their labels."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from forkd import limits
from forkd.errors import Invalid
from forkd.states import (
    OnTimeout,
    SandboxState,
    SnapshotMode,
    SnapshotStatus,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    tag             TEXT PRIMARY KEY,
    dir             TEXT NOT NULL,
    created_at_unix INTEGER NOT NULL,
    branched_from   TEXT,
    pause_ms        REAL,
    parent_tag      TEXT,
    image           TEXT,
    memory_mib      INTEGER NOT NULL,
    status          TEXT NOT NULL DEFAULT 'ready',
    metadata        TEXT NOT NULL DEFAULT '{}',
    mode            TEXT NOT NULL DEFAULT 'full',
    base_tag        TEXT,
    error           TEXT
);
CREATE TABLE IF NOT EXISTS sandboxes (
    id               TEXT PRIMARY KEY,
    snapshot_tag     TEXT NOT NULL,
    run_dir          TEXT NOT NULL,
    pid              INTEGER,
    created_at_unix  INTEGER NOT NULL,
    memory_limit_mib INTEGER,
    expires_at_unix  REAL,
    state            TEXT NOT NULL,
    fork_ms          REAL,
    metadata         TEXT NOT NULL DEFAULT '{}',
    on_timeout       TEXT NOT NULL DEFAULT 'kill',
    timeout_branch   TEXT,
    idle_timeout_s   REAL,
    seed             INTEGER,
    auto_resume      INTEGER NOT NULL DEFAULT 1,
    evictable        INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS branch_seq (
    source_id TEXT PRIMARY KEY,
    seq       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS branch_counts (
    source_id TEXT PRIMARY KEY,
    branches  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS workspaces (
    name                TEXT PRIMARY KEY,
    id                  TEXT NOT NULL,
    source_snapshot_tag TEXT NOT NULL,
    sandbox_id          TEXT,
    created_at_unix     INTEGER NOT NULL,
    last_active_unix    INTEGER NOT NULL,
    per_child_netns     INTEGER NOT NULL DEFAULT 0,
    memory_limit_mib    INTEGER
);
CREATE TABLE IF NOT EXISTS secrets (
    name            TEXT PRIMARY KEY,
    sealed          BLOB NOT NULL,
    hosts           TEXT NOT NULL,
    created_at_unix REAL NOT NULL,
    updated_at_unix REAL NOT NULL,
    last_used_unix  REAL
);
CREATE TABLE IF NOT EXISTS registry_digests (
    snapshot_id TEXT NOT NULL,
    repository  TEXT NOT NULL,
    digest      TEXT NOT NULL,
    PRIMARY KEY (snapshot_id, repository)
);
"""


@dataclass
class SnapshotRow:
    tag: str
    dir: str
    created_at_unix: int
    branched_from: str | None
    pause_ms: float | None
    parent_tag: str | None
    image: str | None
    memory_mib: int
    status: SnapshotStatus  # pending: a branch in the background (set_snapshot_status)
    metadata: dict[str, str] = field(default_factory=dict)  # the user's labels
    mode: SnapshotMode = SnapshotMode.FULL  # diff: the pages that differ from base_tag's
    base_tag: str | None = None  # a diff's base: a dependency, unlike parent_tag
    error: str | None = None  # why a background branch failed (or what failed after it)


@dataclass
class SandboxRow:
    id: str
    snapshot_tag: str
    run_dir: str
    pid: int | None
    created_at_unix: int
    memory_limit_mib: int | None
    expires_at_unix: float | None
    state: SandboxState  # changed by Store.set_sandbox_state only
    fork_ms: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)  # the user's labels
    on_timeout: OnTimeout = OnTimeout.KILL  # what expiry does
    timeout_branch: str | None = None  # the tag an expiry's branch made
    idle_timeout_s: float | None = None  # on_timeout after this long without activity
    seed: int | None = None  # Python's random in it is seeded from this (forked with a seed)
    auto_resume: bool = True  # a request wakes it when paused or hibernated
    evictable: bool = True  # memory pressure may hibernate it when idle


@dataclass
class SecretRow:
    name: str
    sealed: bytes  # forkd.controller.secret_box: never the value itself
    hosts: list[str]  # canonical destinations (forkd.host_names)
    created_at_unix: float
    updated_at_unix: float
    last_used_unix: float | None = None


class SnapshotChanges(TypedDict, total=False):
    """The columns ``update_snapshot`` may change (status: ``set_snapshot_status``)."""

    pause_ms: float | None
    mode: SnapshotMode
    base_tag: str | None
    error: str | None


class SandboxChanges(TypedDict, total=False):
    """The columns ``update_sandbox`` may change (state: ``set_sandbox_state``)."""

    pid: int | None
    fork_ms: float | None
    expires_at_unix: float | None
    on_timeout: OnTimeout
    idle_timeout_s: float | None
    timeout_branch: str | None
    auto_resume: bool
    evictable: bool


class WorkspaceChanges(TypedDict, total=False):
    sandbox_id: str | None
    last_active_unix: int


@dataclass
class WorkspaceRow:
    name: str
    id: str
    source_snapshot_tag: str
    sandbox_id: str | None  # the sandbox holding its state: running, paused or hibernated
    created_at_unix: int
    last_active_unix: int
    per_child_netns: bool = False  # kept for a stale workspace's new sandbox
    memory_limit_mib: int | None = None


def now() -> int:
    return int(time.time())


def labelled(labels: dict[str, str], wanted: dict[str, str] | None) -> bool:
    """Whether ``labels`` (a row's ``metadata``) hold every pair of ``wanted``."""
    return all(labels.get(key) == value for key, value in (wanted or {}).items())


def merged_labels(inherited: dict[str, str], given: dict[str, str] | None) -> dict[str, str]:
    """``given`` over ``inherited``; :class:`~forkd.errors.Invalid` past the cap."""
    merged = {**inherited, **(given or {})}
    if len(merged) > limits.MAX_METADATA_PAIRS:
        raise Invalid(
            f"{len(merged)} labels with those inherited: at most {limits.MAX_METADATA_PAIRS}"
        )
    return merged


def walk_snapshots(
    row: SnapshotRow,
    get: Callable[[str], SnapshotRow | None],
    up: Callable[[SnapshotRow], str | None],
    limit: int | None = None,
) -> list[str]:
    """The tags from ``up(row)`` on (a parent's, a base's), each record read with
    ``get``, nearest first; a cycle, a tag no longer registered or ``limit`` ends it."""
    out: list[str] = []
    tag = up(row)
    while tag and tag not in out and (limit is None or len(out) < limit):
        out.append(tag)
        nxt = get(tag)
        tag = up(nxt) if nxt else None
    return out


# Columns added after the first release of the schema: Store adds those a database lacks.
ADDED_COLUMNS: dict[str, dict[str, str]] = {
    "sandboxes": {
        "fork_ms": "REAL",
        "metadata": "TEXT NOT NULL DEFAULT '{}'",
        "on_timeout": "TEXT NOT NULL DEFAULT 'kill'",
        "timeout_branch": "TEXT",
        "idle_timeout_s": "REAL",
        "seed": "INTEGER",
        "auto_resume": "INTEGER NOT NULL DEFAULT 1",
        "evictable": "INTEGER NOT NULL DEFAULT 1",
    },
    "snapshots": {
        "metadata": "TEXT NOT NULL DEFAULT '{}'",
        "mode": "TEXT NOT NULL DEFAULT 'full'",
        "base_tag": "TEXT",
        "error": "TEXT",
    },
}
