"""Shared volumes (E2B's): named directories that sandboxes mount at create and that
every sandbox mounting one reads and writes at once.

The files are :class:`~forkd.vmm.volumes.share_disks.ShareDisks`'; a sandbox reaches
them through a 9p share slot (:mod:`forkd.vmm.volumes.shares`). This service keeps the
volumes' records and which sandbox and snapshot mounts which, in tables of its own in
the daemon's store:

- a sandbox's shares are given to its QEMU again when it wakes from hibernation;
- a branch records its source's, and every fork of it mounts them too (a volume is
  shared, never copied: E2B's volumes outlive and span sandboxes).

A volume is deleted only when no sandbox mounts it; a snapshot that named it then
forks without it. A sandbox is recorded as mounting its volumes before its QEMU starts,
in a statement that finds each volume still there, and a delete checks for mounts and
removes the record in one transaction: the two never cross.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from forkd.controller.store import Store
from forkd.disk_reserve import free_bytes
from forkd.errors import Conflict, Invalid, NotFound, StorageFull
from forkd.states import SandboxState
from forkd.vmm.volumes.share_disks import ShareDisks
from forkd.vmm.volumes.shares import SHARE_SLOTS, Share, check_guest_path, check_shares

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS shared_volumes (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    size_bytes      INTEGER NOT NULL,
    created_at_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sandbox_shares (
    sandbox_id TEXT NOT NULL,
    slot       INTEGER NOT NULL,
    volume_id  TEXT NOT NULL,
    path       TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, slot)
);
CREATE TABLE IF NOT EXISTS snapshot_shares (
    snapshot_tag TEXT NOT NULL,
    made_at      REAL NOT NULL,
    slot         INTEGER NOT NULL,
    volume_id    TEXT NOT NULL,
    path         TEXT NOT NULL,
    PRIMARY KEY (snapshot_tag, slot)
);
"""
# E2B's rule for a volume's name: letters, digits, '-' and '_' (never an id's form).
VOLUME_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,63}")
VOLUME_ID_RE = re.compile(r"vol-[0-9a-f]{16}")
MAX_VOLUMES = 256


@dataclass(frozen=True)
class SharedVolume:
    id: str
    name: str
    size_bytes: int
    created_at_unix: float


@dataclass(frozen=True)
class ShareMount:
    """A volume (its id or name) asked for at ``path`` in a new sandbox."""

    volume: str
    path: str


class SharedVolumes:
    def __init__(self, store: Store, root: Path, size_bytes: int, reserve_mib: int = 0) -> None:
        self.store = store
        self.disks = ShareDisks(root)
        self.size_bytes = size_bytes
        self.reserve_mib = reserve_mib  # --disk-reserve: a new volume must fit above it
        self._lock = threading.Lock()  # one create at a time (its name, the count, room)
        with store.transaction() as db:
            for table in SCHEMA.split(";"):
                if table.strip():
                    db.execute(table)

    # ------------------------------------------------------------ the volumes

    def start(self) -> None:
        """At the daemon's start: finish what a crash left, mount every volume."""
        self.disks.sweep()
        known = {v.id for v in self.all()}
        for orphan in set(self.disks.known()) - known:  # made, never recorded: a crash
            try:
                self.disks.remove(orphan)
            except Exception:
                log.exception("leftover shared volume %s could not be removed", orphan)
        for volume_id in sorted(known):
            try:
                self.disks.mount(volume_id)
            except Exception:  # one broken volume must not stop the daemon
                log.exception("shared volume %s could not be mounted", volume_id)

    def stop(self) -> None:
        """At the daemon's stop: the volumes' filesystems unmounted, but those a sandbox
        left running still serves (its QEMU holds the directory open: the unmount is
        refused, never forced). The next daemon finds those mounted and leaves them."""
        for volume in self.all():
            try:
                self.disks.unmount(volume.id)
            except Exception as exc:
                log.info("shared volume %s stays mounted: %s", volume.id, exc)

    async def create(self, name: str) -> SharedVolume:
        if (
            not isinstance(name, str)
            or not VOLUME_NAME_RE.fullmatch(name)
            or VOLUME_ID_RE.fullmatch(name)
        ):
            raise Invalid(f"invalid volume name {name!r}: 1-63 letters, digits, '-' or '_'")
        return await asyncio.to_thread(self._create, name)

    def _create(self, name: str) -> SharedVolume:
        with self._lock:
            if self._find(name) is not None:
                raise Conflict(f"a volume named {name!r} exists")
            if len(self.all()) >= MAX_VOLUMES:
                raise Conflict(f"this daemon holds {MAX_VOLUMES} volumes: destroy one first")
            # Sparse, but it may fill: a whole one must fit above the disk reserve.
            need_mib = self.reserve_mib + (self.size_bytes >> 20)
            free_mib = free_bytes(self.disks.root) >> 20
            if free_mib < need_mib:
                raise StorageFull(
                    f"a volume may hold {self.size_bytes >> 20} MiB and the disk must keep "
                    f"{self.reserve_mib} MiB free (--disk-reserve): {free_mib} MiB are free"
                )
            volume = SharedVolume(f"vol-{secrets.token_hex(8)}", name, self.size_bytes, time.time())
            self.disks.create(volume.id, volume.size_bytes)
            try:
                with self.store.transaction() as db:
                    db.execute(
                        "INSERT INTO shared_volumes VALUES (?, ?, ?, ?)",
                        (volume.id, name, volume.size_bytes, volume.created_at_unix),
                    )
            except BaseException:
                self.disks.remove(volume.id)
                raise
        return volume

    def all(self) -> list[SharedVolume]:
        rows = self.store.query("SELECT * FROM shared_volumes ORDER BY created_at_unix, id")
        return [SharedVolume(**dict(r)) for r in rows]

    def _find(self, ref: str) -> SharedVolume | None:
        column = "id" if VOLUME_ID_RE.fullmatch(ref) else "name"  # names never look like ids
        rows = self.store.query(f"SELECT * FROM shared_volumes WHERE {column} = ?", (ref,))
        return SharedVolume(**dict(rows[0])) if rows else None

    def get(self, ref: str) -> SharedVolume:
        """The volume of id or name ``ref``."""
        found = self._find(ref) if isinstance(ref, str) else None
        if found is None:
            raise NotFound(f"no volume {ref!r}")
        return found

    async def delete(self, ref: str) -> None:
        volume = self.get(ref)
        with self.store.transaction() as db:  # no mount is recorded between check and delete
            users = self.users(volume.id)
            if users:
                raise Conflict(
                    f"volume {volume.name!r} is mounted by {', '.join(users)}: kill them first"
                )
            db.execute("DELETE FROM shared_volumes WHERE id = ?", (volume.id,))
            db.execute("DELETE FROM snapshot_shares WHERE volume_id = ?", (volume.id,))
        # Nothing can mount it now; a download still reading finishes first (lazily).
        await asyncio.to_thread(self.disks.remove, volume.id)

    def users(self, volume_id: str) -> list[str]:
        """The sandboxes that mount the volume (recorded, not dead)."""
        rows = self.store.query(
            "SELECT s.sandbox_id FROM sandbox_shares s JOIN sandboxes b ON b.id = s.sandbox_id "
            "WHERE s.volume_id = ? AND b.state != ? ORDER BY s.sandbox_id",
            (volume_id, SandboxState.DEAD.value),
        )
        return [r["sandbox_id"] for r in rows]

    def data_dir(self, volume: SharedVolume) -> Path:
        """Where the volume's files are: :class:`Unavailable` unless its own filesystem is
        mounted there (never the bare directory beneath, on the host's disk)."""
        return self.disks.mounted_data(volume.id)

    # ------------------------------------------------------------ who mounts what

    def shares_for(self, mounts: Sequence[ShareMount]) -> list[Share]:
        """The shares a new sandbox is given for ``mounts``, a slot each, checked."""
        out = []
        for slot, mount in enumerate(mounts):
            volume = self.get(mount.volume)
            path = check_guest_path(mount.path)
            out.append(Share(slot, self.data_dir(volume), path, name=volume.name))
        check_shares(out, SHARE_SLOTS)
        return out

    def _shares(self, table: str, where: str, args: tuple[object, ...]) -> list[Share]:
        """The shares recorded in ``table`` (its rows ``where``), of volumes that still
        exist (one destroyed since is left out: a fork goes on without it)."""
        rows = self.store.query(
            f"SELECT s.slot, s.path, v.id, v.name FROM {table} s "
            f"JOIN shared_volumes v ON v.id = s.volume_id WHERE {where} ORDER BY s.slot",
            args,
        )
        return [
            Share(r["slot"], self.disks.mounted_data(r["id"]), r["path"], name=r["name"])
            for r in rows
        ]

    def attach(self, sandbox_id: str, shares: Sequence[Share]) -> None:
        """Record that ``sandbox_id`` mounts ``shares``, before its QEMU starts (a wake
        gives them again): :class:`NotFound` if one was deleted since it was asked for."""
        with self.store.transaction() as db:
            db.execute(  # and the rows of sandboxes gone since
                "DELETE FROM sandbox_shares WHERE sandbox_id = ? "
                "OR sandbox_id NOT IN (SELECT id FROM sandboxes)",
                (sandbox_id,),
            )
            for share in shares:
                added = db.execute(
                    "INSERT INTO sandbox_shares SELECT ?, ?, id, ? FROM shared_volumes "
                    "WHERE id = ?",
                    (
                        sandbox_id,
                        share.slot,
                        share.guest_path,
                        self.disks.volume_of(share.host_dir),
                    ),
                )
                if added.rowcount != 1:
                    raise NotFound(f"volume {share.name!r} was destroyed meanwhile")

    def of_sandbox(self, sandbox_id: str) -> list[Share]:
        return self._shares("sandbox_shares", "s.sandbox_id = ?", (sandbox_id,))

    def record_branch(self, tag: str, made_at: float, sandbox_id: str) -> None:
        """A branch of ``sandbox_id``: every fork of ``tag`` (as made at ``made_at``)
        mounts what the sandbox mounts. Copied row for row: no volume need be mounted
        on the host for a branch to be taken."""
        with self.store.transaction() as db:
            db.execute("DELETE FROM snapshot_shares WHERE snapshot_tag = ?", (tag,))
            db.execute(
                "INSERT INTO snapshot_shares SELECT ?, ?, slot, volume_id, path "
                "FROM sandbox_shares WHERE sandbox_id = ?",
                (tag, made_at, sandbox_id),
            )

    def of_snapshot(self, tag: str, made_at: float) -> list[Share]:
        where = "s.snapshot_tag = ? AND s.made_at = ?"
        return self._shares("snapshot_shares", where, (tag, made_at))
