"""The records a request names: a snapshot by its tag, a sandbox by its id, and a tag
held for a snapshot being made. A name that is not there is a :class:`NotFound`
that says so (with the tags it may have meant)."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from pathlib import Path

from forkd.controller.services.activity import Activity
from forkd.controller.services.holds import Holds
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow, SnapshotRow
from forkd.errors import Conflict, NotFound
from forkd.limits import check_tag


class Records:
    def __init__(self, store: Store, snapshot_root: Path, holds: Holds, activity: Activity) -> None:
        self.store = store
        self.snapshot_root = snapshot_root
        self.holds = holds
        self.activity = activity

    @contextlib.contextmanager
    def reserve_tag(self, tag: str) -> Iterator[str]:
        """Hold ``tag`` for a snapshot being created; :class:`Conflict` if taken."""
        if self.store.get_snapshot(tag) is not None or (self.snapshot_root / tag).exists():
            raise Conflict(f"snapshot {tag!r} already exists")
        over = [r.tag for r in self.store.list_snapshots() if r.base_tag == tag]
        if over:  # a new snapshot of that tag would not be what they are diffs over
            raise Conflict(
                f"snapshot {tag!r} was deleted but diff snapshots {', '.join(over)} are still "
                "recorded over it: delete them first"
            )
        with self.holds.new_tag(tag):
            yield tag

    def snapshot_row(self, tag: str) -> SnapshotRow:
        check_tag(tag)
        row = self.store.get_snapshot(tag)
        if row is None:
            tags = [r.tag for r in self.store.list_snapshots()]
            close = difflib.get_close_matches(tag, tags, n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise NotFound(f"snapshot {tag!r} not found{hint}")
        return row

    def sandbox_row(self, sandbox_id: str) -> SandboxRow:
        """The sandbox's record, for a call touching it (its idle clock starts again)."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        self.activity.touch(sandbox_id)
        return row
