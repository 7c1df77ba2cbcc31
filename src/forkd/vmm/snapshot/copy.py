"""Copy a committed snapshot directory under a new name, with new labels.

A branch of a hibernated sandbox is its hibernation snapshot as it is: no VM
to pause, only files to copy. The copy is staged beside ``dest`` and renamed
into place when whole; ``memory.bin`` keeps its holes (a reflink where the
filesystem has one). With a ``base``, the copy is a diff over that snapshot:
only the pages that differ from its memory (:mod:`forkd.vmm.snapshot.memory_diff`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TypedDict

from forkd.errors import SnapshotError, StorageFull
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory, memory_diff
from forkd.vmm.snapshot.files import BaseRef, SnapshotFiles, SnapshotLabels


class _DiffFields(TypedDict, total=False):
    """What a copy's ``snapshot.json`` says of its memory when it is a diff (nothing for a
    full copy: the source's own fields stand)."""

    mode: str
    base: BaseRef
    chain: tuple[BaseRef, ...]
    pages_written: int
    format: int


def copy_snapshot(
    src: Path,
    dest: Path,
    labels: SnapshotLabels,
    skip: tuple[str, ...] = (),
    base: BaseRef | None = None,
) -> SnapshotFiles:
    """Copy the snapshot at ``src`` (a full one) to ``dest`` (which must not exist),
    relabelled; its other files too, but those named in ``skip``. With ``base``,
    the copy's memory is a diff over that snapshot.

    On failure nothing is left at ``dest`` or in staging; a full disk is
    :class:`StorageFull`.
    """
    if dest.exists():
        raise SnapshotError(f"{dest} already exists")
    files = snapshot_files.load(src)
    staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(3)}"
    try:
        staging.mkdir(mode=0o700)
        if base is None:
            _copy_memory(files.memory, staging / snapshot_files.MEMORY, files.meta.memory_bytes)
            diff: _DiffFields = {}
        else:
            diff = _diff_memory(files, staging, base)
        for path in src.iterdir():
            if path.is_file() and path.name not in (
                snapshot_files.META,
                snapshot_files.MEMORY,
                *skip,
            ):
                shutil.copyfile(path, staging / path.name)
        meta = dataclasses.replace(
            files.meta,
            created_at_unix=int(time.time()),
            tag=labels.tag,
            branched_from=labels.branched_from,
            parent_tag=labels.parent_tag,
            pause_ms=labels.pause_ms,
            id=snapshot_files.new_id(),  # another snapshot: the compaction alone keeps an id
            **diff,
        )
        meta_path = snapshot_files.write_meta(staging, meta)
        for path in (staging / snapshot_files.VMSTATE, meta_path):
            path.chmod(0o600)
            snapshot_files.fsync_path(path)
        snapshot_files.fsync_path(staging)
        staging.rename(dest)
        snapshot_files.fsync_path(dest.parent)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise StorageFull(f"disk full while copying snapshot {src.name} to {dest}") from exc
        raise
    return SnapshotFiles(dest, meta)


def _diff_memory(files: SnapshotFiles, staging: Path, base: BaseRef) -> _DiffFields:
    """Write ``files``' memory as a diff over ``base`` into ``staging``; the record's fields."""
    base_files = snapshot_files.load(Path(base.dir))
    if base.id is not None and base_files.meta.id != base.id:
        raise SnapshotError(f"{base.tag!r} was replaced by another snapshot of that tag")
    if base_files.meta.memory_bytes != files.meta.memory_bytes:
        raise SnapshotError(f"{base.tag!r} has another memory size: no diff over it")
    out_fd = os.open(
        staging / snapshot_files.MEMORY_DIFF, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
    )
    try:
        os.ftruncate(out_fd, files.meta.memory_bytes)
        with memory_diff.resolve(base_files) as chain:
            cap = memory_diff.diff_of_file(
                files.memory, chain, out_fd, staging / snapshot_files.MEMORY_RUNS
            )
        os.fsync(out_fd)
    finally:
        os.close(out_fd)
    return {
        "mode": "diff",
        "base": base,
        "chain": (*base_files.meta.chain, base),
        "pages_written": cap.pages_kept,
        "format": snapshot_files.DIFF_FORMAT,
    }


def _copy_memory(src: Path, out: Path, size: int) -> None:
    src_fd = os.open(src, os.O_RDONLY)
    try:
        out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(out_fd, size)
            memory.copy_sparse(src_fd, out_fd, size, str(src))
            os.fsync(out_fd)
        finally:
            os.close(out_fd)
    finally:
        os.close(src_fd)
