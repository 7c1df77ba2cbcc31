"""What an image import leaves when the daemon dies mid-way (kill -9, a crash, the OOM
killer), found and ended when a daemon starts: :func:`sweep`.

An import writes into places it owns for a while: a staging directory beside the
images (``.staging-...``), temporary files in the blob store (a layer on its way
in, an archive a client sent) and a worker process that flattens the layers,
whose ``tar2sqfs`` runs as a uid leased for it. Each is marked with its owner,
the process that made it (``@PID.TICKS.``: its pid and start time, so a later
process with the same pid is told apart), and a worker is recorded under the
cache's ``workers/`` while it runs. Several forkd processes may share the cache
(a daemon, a ``forkd image build``, a second daemon), so a starting daemon
removes only what belongs to a process that is gone, and kills only workers whose
parent is gone (a worker and its ``tar2sqfs`` also die with their parent on
their own: a parent-death signal, :func:`die_with_parent`). What carries no mark
(made by an older forkd) is removed once it is :data:`UNMARKED_STALE_SECS` old.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd import paths, processes
from forkd.processes import Holder

log = logging.getLogger(__name__)

UNMARKED_STALE_SECS = 3600.0
WORKERS = "workers"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Be killed when the parent goes (``PR_SET_PDEATHSIG``): for a worker, as it starts
    (its parent is checked afterwards: it may be gone already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ---------------------------------------------------------------------- workers


@dataclass(frozen=True)
class WorkerRecord:
    path: Path
    worker: Holder
    parent: Holder | None


@contextlib.contextmanager
def recorded_worker(pid: int) -> Iterator[None]:
    """Record worker ``pid`` (a child of this process) for the block: a daemon that
    starts after this one died kills it if it still runs."""
    worker = Holder.of(pid)
    if worker is None:  # gone already
        yield
        return
    directory = paths.cache_dir() / WORKERS
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{worker.mark()}worker"
    staged = directory / f".{path.name}.{os.getpid()}"
    staged.write_text(processes.mark() + "\n")
    os.replace(staged, path)  # whole: a sweep never reads a record without its parent
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _workers() -> Iterator[WorkerRecord]:
    directory = paths.cache_dir() / WORKERS
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        worker = processes.marked_by(name)
        if worker is None:
            continue
        path = directory / name
        try:
            parent = processes.marked_by(path.read_text())
        except OSError:
            parent = None
        yield WorkerRecord(path, worker, parent)


# ---------------------------------------------------------------------- the sweep


@dataclass
class Swept:
    workers_killed: int = 0
    removed: int = 0  # staging directories and temporary files


def sweep(now: float | None = None) -> Swept:
    """End what imports of processes now gone left: their workers (killed), staging
    directories and temporary blob files (removed). Run as a daemon starts."""
    now = time.time() if now is None else now
    done = Swept()
    for record in _workers():
        if record.parent is not None and record.parent.alive():
            continue  # its import still runs
        if record.worker.alive():
            log.warning("killing image worker %d, left by a daemon that died", record.worker.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.worker.pid, signal.SIGKILL)
            done.workers_killed += 1
        record.path.unlink(missing_ok=True)
    candidates = [
        *_entries(paths.images_dir(), (".staging-", ".removing-")),
        *_entries(paths.blobs_dir() / "tmp", ("",)),
    ]
    for path in candidates:
        if _orphaned(path, now):
            log.info("removing %s, left by an import that did not finish", path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            done.removed += 1
    return done


def _entries(directory: Path, prefixes: tuple[str, ...]) -> list[Path]:
    try:
        return [directory / n for n in os.listdir(directory) if n.startswith(prefixes)]
    except FileNotFoundError:
        return []


def _orphaned(path: Path, now: float) -> bool:
    if path.name.startswith(".removing-"):
        return True  # a removal's trash: deleting it twice is harmless
    made_by = processes.marked_by(path.name)
    if made_by is not None:
        return not made_by.alive()
    try:
        return now - path.lstat().st_mtime > UNMARKED_STALE_SECS
    except FileNotFoundError:
        return False
