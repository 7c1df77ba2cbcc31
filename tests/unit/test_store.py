"""The SQLite registry: rows round-trip, sequences survive a reopen, writes are atomic."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow
from forkd.errors import NotFound
from forkd.states import IllegalTransition, SandboxState, SnapshotStatus


def snap(tag: str, parent: str | None = None) -> SnapshotRow:
    return SnapshotRow(tag, f"/s/{tag}", 1, None, None, parent, "python", 256, SnapshotStatus.READY)


def sandbox(sid: str) -> SandboxRow:
    return SandboxRow(sid, "base", f"/r/{sid}", None, 2, None, None, SandboxState.STARTING)


def test_snapshot_rows_round_trip_and_tags_are_unique(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.add_snapshot(snap("a"))
    store.add_snapshot(snap("b", parent="a"))
    assert store.get_snapshot("b") == snap("b", parent="a")
    assert [r.tag for r in store.list_snapshots()] == ["a", "b"]
    with pytest.raises(sqlite3.IntegrityError):
        store.add_snapshot(snap("a"))
    assert store.delete_snapshot("a") and not store.delete_snapshot("a")
    assert store.get_snapshot("a") is None


def test_sandbox_updates(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.add_sandbox(sandbox("sb-1"))
    store.set_sandbox_state("sb-1", SandboxState.RUNNING, pid=42, fork_ms=12.5)
    row = store.get_sandbox("sb-1")
    assert row is not None and (row.state, row.pid, row.fork_ms) == ("running", 42, 12.5)
    assert store.delete_sandbox("sb-1") and store.list_sandboxes() == []


def test_sequences_survive_a_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    ids = [store.next_sandbox_id() for _ in range(2)]
    seqs = [store.next_branch_seq("sb-1") for _ in range(2)]
    store.close()
    again = Store(tmp_path / "db")
    assert again.id_prefix == store.id_prefix
    assert again.next_sandbox_id() not in ids
    assert ids[0].startswith(f"sb-{store.id_prefix}-")
    assert seqs == [1, 2] and again.next_branch_seq("sb-1") == 3
    assert again.next_branch_seq("sb-2") == 1


def test_a_failed_write_changes_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.add_snapshot(snap("a"))
    with pytest.raises(sqlite3.IntegrityError):
        store.add_snapshot(snap("a"))
    assert [r.tag for r in store.list_snapshots()] == ["a"]
    store.add_sandbox(sandbox("sb-1"))  # the store still takes writes
    assert store.get_sandbox("sb-1") is not None


def test_only_known_columns_are_written_and_state_only_along_its_table(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.add_sandbox(sandbox("sb-1"))
    with pytest.raises(ValueError, match="no changeable column 'no_such_column'"):
        store.update_sandbox("sb-1", no_such_column=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="'state'"):  # a state moves by set_sandbox_state
        store.update_sandbox("sb-1", state="dead")  # type: ignore[call-arg]
    assert store.set_sandbox_state("sb-1", SandboxState.RUNNING, pid=7) == "starting"
    store.set_sandbox_state("sb-1", SandboxState.DEAD)
    with pytest.raises(IllegalTransition, match="is dead: it cannot become running"):
        store.set_sandbox_state("sb-1", SandboxState.RUNNING, pid=8)
    row = store.get_sandbox("sb-1")
    assert row is not None and (row.state, row.pid) == (SandboxState.DEAD, 7)  # unchanged
    with pytest.raises(NotFound):
        store.set_sandbox_state("sb-2", SandboxState.DEAD)


def test_a_branch_recorded_as_pending_by_an_older_daemon_reads_as_writing(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "db")
    writing = snap("b")
    writing.status = SnapshotStatus.WRITING
    store.add_snapshot(writing)
    store.close()
    with sqlite3.connect(tmp_path / "db") as db:  # as a daemon before the rename left it
        db.execute("UPDATE snapshots SET status = 'pending' WHERE tag = 'b'")
    row = Store(tmp_path / "db").get_snapshot("b")
    assert row is not None and row.status == SnapshotStatus.WRITING


def test_a_pending_snapshot_settles_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    pending = snap("b")
    pending.status = SnapshotStatus.WRITING
    store.add_snapshot(pending)
    store.add_snapshot(snap("b"), replace=True)  # pending -> ready
    store.add_snapshot(snap("b"), replace=True)  # ready -> ready: a compaction in place
    with pytest.raises(IllegalTransition):
        store.set_snapshot_status("b", SnapshotStatus.FAILED, error="late")
    row = store.get_snapshot("b")
    assert row is not None and (row.status, row.error) == (SnapshotStatus.READY, None)
