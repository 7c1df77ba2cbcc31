"""Compact a diff snapshot in place: flatten its chain into a full ``memory.bin``.

The full copy is staged beside the snapshot (``.<name>.partial-compact-*``) and
swapped with it in one ``renameat2(RENAME_EXCHANGE)``: the directory always
holds either the diff or the full snapshot, never neither. The diff's files
then go; no VM maps them (a fork of a diff maps the chain's root and has
copied the layers into its own memory before it runs, and a fork in flight
holds their descriptors), and the root ``memory.bin`` is not touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forkd.errors import SnapshotError, StorageFull
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import SnapshotFiles

AT_FDCWD = -100
RENAME_EXCHANGE = 1 << 1
_DIFF_FILES = (snapshot_files.META, snapshot_files.MEMORY_DIFF, snapshot_files.MEMORY_RUNS)


def exchange(a: Path, b: Path) -> None:
    """Swap the directory entries ``a`` and ``b`` atomically."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise SnapshotError("this C library has no renameat2: cannot swap a snapshot atomically")
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"swapping {a} and {b}: {os.strerror(err)}")


def compact(snap_dir: Path) -> SnapshotFiles:
    """Make the diff snapshot at ``snap_dir`` a full one with the same content.

    A full snapshot is returned as it is. On failure the diff is left as it was
    and the staging directory removed; a full disk is :class:`StorageFull`.
    """
    files = snapshot_files.load(snap_dir)
    if not files.is_diff:
        return files
    staging = _staging_beside(snap_dir)
    with _staged(staging, f"compacting {snap_dir.name}"):
        meta = _write_full(files, staging)
        exchange(staging, snap_dir)
    snapshot_files.fsync_path(snap_dir.parent)
    shutil.rmtree(staging, ignore_errors=True)  # the diff's files, now under the staging name
    return SnapshotFiles(snap_dir, meta)


def compact_to(snap_dir: Path, dest: Path, labels: snapshot_files.SnapshotLabels) -> SnapshotFiles:
    """A new full snapshot at ``dest`` with the content of the one at ``snap_dir`` (its diff
    chain flattened, a full one copied), labelled ``labels``, with its own id; the source
    is not touched. Staged beside ``dest`` and renamed into place: on failure nothing is
    left, and a full disk is :class:`StorageFull`."""
    if dest.exists():
        raise SnapshotError(f"{dest.name} already exists")
    files = snapshot_files.load(snap_dir)
    staging = _staging_beside(dest)
    with _staged(staging, f"compacting {snap_dir.name} to {dest.name}"):
        meta = _write_full(
            files,
            staging,
            id=snapshot_files.new_id(),
            tag=labels.tag,
            branched_from=labels.branched_from,
            parent_tag=labels.parent_tag,
            pause_ms=labels.pause_ms,
            parent_id=files.meta.id,
        )
        os.rename(staging, dest)
    snapshot_files.fsync_path(dest.parent)
    return SnapshotFiles(dest, meta)


def _staging_beside(snap_dir: Path) -> Path:
    return snap_dir.parent / f".{snap_dir.name}.partial-compact-{secrets.token_hex(3)}"


@contextlib.contextmanager
def _staged(staging: Path, doing: str) -> Iterator[None]:
    """Make ``staging``; if the block fails, remove it and say what failed (a full disk is
    :class:`StorageFull`)."""
    try:
        staging.mkdir(mode=0o700)
        yield
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise StorageFull(f"disk full while {doing}") from exc
        if isinstance(exc, OSError):
            raise SnapshotError(f"{doing} failed: {exc}") from exc
        raise


def _write_full(files: SnapshotFiles, staging: Path, **relabel: Any) -> snapshot_files.SnapshotMeta:
    out = os.open(staging / snapshot_files.MEMORY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with memory_diff.resolve(files) as chain:
            copied = memory_diff.flatten(chain, out)
        os.fsync(out)
    finally:
        os.close(out)
    for path in files.dir.iterdir():
        if path.is_file() and path.name not in (*_DIFF_FILES, snapshot_files.MEMORY):
            shutil.copyfile(path, staging / path.name)
            (staging / path.name).chmod(0o600)
    meta = dataclasses.replace(
        files.meta,
        mode="full",
        base=None,
        chain=(),
        base_bytes_cloned=copied,
        format=snapshot_files.FORMAT,
        **relabel,
    )
    meta_path = snapshot_files.write_meta(staging, meta)
    meta_path.chmod(0o600)
    for path in (*staging.iterdir(), staging):
        snapshot_files.fsync_path(path)
    return meta
