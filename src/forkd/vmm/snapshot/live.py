"""Snapshot a VM: pause → snapshot → resume, with the failure table.

The one way a VM is snapshotted, for templates, branches and hibernation alike
(a branch is a snapshot of a running sandbox). How the memory is written is the
writer's strategy (:mod:`forkd.vmm.snapshot.memory_strategy`: full, live or diff); a VM
already paused is snapshotted as it is, in one place (:func:`_snapshot_paused`);
and a failure is wrapped once, in :class:`LiveSnapshotError`, whose ``reason``
is the error the snapshot failed with.

| failure                          | answer | afterwards                               |
|----------------------------------|--------|------------------------------------------|
| pause fails                      | 500    | source as it was                         |
| snapshot write fails (disk full) | 500    | source resumed, partial files removed    |
| resume fails after good snapshot | 500    | branch kept and valid; source dead       |

The snapshot is committed (renamed into place) only after the source runs
again, and the caller registers it last. The table holds for a full snapshot
and a diff (``base`` given) alike: a diff only stages, captures and commits
different files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from forkd import tracing
from forkd.errors import ForkdError, SnapshotError, StorageFull
from forkd.states import VMState
from forkd.vmm.snapshot.files import BaseRef, SnapshotFiles, SnapshotLabels, SnapshotMeta


class Writer(Protocol):
    """:class:`forkd.vmm.snapshot.writer.SnapshotWriter`, as this module drives it."""

    async def capture(self) -> None: ...
    async def commit(self, labels: SnapshotLabels | None = None) -> SnapshotMeta: ...
    async def abort(self) -> None: ...


class SnapshottableVM(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def state(self) -> VMState: ...

    async def begin_snapshot(
        self, dest: Path, base: BaseRef | None = None, *, live: bool = False
    ) -> Writer: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    def is_alive(self) -> bool: ...


class LiveSnapshotError(ForkdError):
    """A live snapshot failed; ``source_alive`` tells whether the source still runs,
    ``snapshot_kept`` whether a valid snapshot was left at the destination."""

    def __init__(self, message: str, *, source_alive: bool, snapshot_kept: bool) -> None:
        super().__init__(message)
        self.source_alive = source_alive
        self.snapshot_kept = snapshot_kept

    @property
    def reason(self) -> ForkdError | None:
        """The error the snapshot failed with (a full disk, a busy agent channel, QEMU
        gone), when forkd raised it; None for anything else (an OSError)."""
        cause = self.__cause__
        return cause if isinstance(cause, ForkdError) else None


@dataclass(frozen=True)
class LiveSnapshot:
    """A committed snapshot: its directory, how long the source was paused, its record."""

    dir: Path
    pause_ms: float
    meta: SnapshotMeta


async def _begin(
    vm: SnapshottableVM, dest: Path, base: BaseRef | None, live: bool = False
) -> Writer:
    """Stage the snapshot (the VM still runs); a failure leaves the source as it was."""
    try:
        if base is not None:
            return await vm.begin_snapshot(dest, base)
        return await (vm.begin_snapshot(dest, live=True) if live else vm.begin_snapshot(dest))
    except ForkdError as exc:
        raise LiveSnapshotError(
            f"preparing the snapshot failed: {exc}", source_alive=vm.is_alive(), snapshot_kept=False
        ) from exc


async def snapshot_running(
    vm: SnapshottableVM,
    dest: Path,
    labels: SnapshotLabels | None = None,
    base: BaseRef | None = None,
    *,
    live: bool = False,
    on_resumed: Callable[[float], None] | None = None,
) -> LiveSnapshot:
    """Snapshot the running ``vm`` into ``dest``; see the module's failure table.

    ``on_resumed(pause_ms)`` is called once the source runs again (the pause window is
    over), before the snapshot's files are written out.

    ``labels`` are recorded in ``snapshot.json`` with the pause window (``pause_ms``).
    A VM already paused (``state`` paused, or warm in the pool) is snapshotted as it is and left
    paused: no pause of its own, ``pause_ms`` 0. With ``base`` (the snapshot the
    VM was forked from) the snapshot is a diff over it. ``live``: the guest's pages
    are copied before the pause too, and the pause only copies what changed since.
    """
    if vm.state in (VMState.PAUSED, VMState.WARM):  # vCPUs already stopped: no pause of its own
        if on_resumed is not None:
            on_resumed(0.0)  # no pause of its own
        return await _snapshot_paused(vm, dest, labels, base)
    writer = await _begin(vm, dest, base, live)

    paused_at = time.monotonic()
    with tracing.span("snapshot.pause", vm_id=vm.id):
        await _pause(vm, writer)
        with tracing.span("snapshot.capture", vm_id=vm.id):
            await _capture(vm, writer)
        resume_error = await _resume(vm, writer)
    pause_ms = round((time.monotonic() - paused_at) * 1000, 1)
    if on_resumed is not None and resume_error is None:
        on_resumed(pause_ms)

    with tracing.span("snapshot.write", vm_id=vm.id):
        meta = await _commit(vm, writer, labels, pause_ms, resumed=resume_error is None)
    if resume_error is not None:
        raise LiveSnapshotError(
            f"the snapshot succeeded but resuming {vm.id} failed ({resume_error}); "
            f"the snapshot {dest.name} is kept and valid, the source is dead",
            source_alive=False,
            snapshot_kept=True,
        )
    return LiveSnapshot(dest, pause_ms, meta)


async def _pause(vm: SnapshottableVM, writer: Writer) -> None:
    """Pause the source; on failure drop the staged files and leave it running."""
    try:
        await vm.pause()
    except BaseException as exc:  # cancellation too: never leave staging files
        await writer.abort()
        if not isinstance(exc, ForkdError):
            if vm.is_alive():
                with contextlib.suppress(Exception):
                    await vm.resume()  # the stop may have gone through
            raise
        raise LiveSnapshotError(
            f"pausing {vm.id} failed: {exc}", source_alive=vm.is_alive(), snapshot_kept=False
        ) from exc


async def _capture(vm: SnapshottableVM, writer: Writer) -> None:
    """Capture the paused source; on failure drop the capture and resume the source."""
    try:
        await writer.capture()
    except BaseException as exc:  # cancellation too: the source must not stay paused
        await writer.abort()
        alive = vm.is_alive()
        if alive:
            try:
                await vm.resume()
            except ForkdError:
                alive = False
        if not isinstance(exc, ForkdError):
            raise
        raise LiveSnapshotError(str(exc), source_alive=alive, snapshot_kept=False) from exc


async def _resume(vm: SnapshottableVM, writer: Writer) -> ForkdError | None:
    """Resume the source after a good capture: its failure is returned, since the
    snapshot is still committed (the table's last row)."""
    try:
        await vm.resume()
    except ForkdError as exc:
        return exc
    except BaseException:  # cancelled while resuming: drop the capture, not the files
        await writer.abort()
        raise
    return None


async def _commit(
    vm: SnapshottableVM,
    writer: Writer,
    labels: SnapshotLabels | None,
    pause_ms: float,
    *,
    resumed: bool,
) -> SnapshotMeta:
    """Write the captured snapshot into place, its pause window recorded."""
    try:
        return await writer.commit(
            dataclasses.replace(labels or SnapshotLabels(), pause_ms=pause_ms)
        )
    except (ForkdError, OSError) as exc:
        # commit() removed its files; the source is running unless resume failed.
        with contextlib.suppress(Exception):
            await writer.abort()
        raise LiveSnapshotError(
            f"writing the snapshot failed: {exc}",
            source_alive=resumed and vm.is_alive(),
            snapshot_kept=False,
        ) from exc


async def _snapshot_paused(
    vm: SnapshottableVM, dest: Path, labels: SnapshotLabels | None, base: BaseRef | None
) -> LiveSnapshot:
    """The paused ``vm``'s state exactly as it is; it stays paused whatever happens."""
    writer = await _begin(vm, dest, base)
    try:
        await writer.capture()
        meta = await writer.commit(dataclasses.replace(labels or SnapshotLabels(), pause_ms=0.0))
    except BaseException as exc:  # cancellation too: never leave staging files
        with contextlib.suppress(Exception):
            await writer.abort()
        if not isinstance(exc, ForkdError | OSError):
            raise
        raise LiveSnapshotError(
            f"writing the snapshot failed: {exc}", source_alive=vm.is_alive(), snapshot_kept=False
        ) from exc
    return LiveSnapshot(dest, 0.0, meta)


async def write(
    vm: SnapshottableVM,
    dest: Path,
    labels: SnapshotLabels | None = None,
    base: BaseRef | None = None,
    *,
    live: bool = False,
) -> SnapshotFiles:
    """:func:`snapshot_running` for a caller with no sandbox to keep in line (a
    template, a benchmark): the error is a :class:`SnapshotError`, or
    :class:`StorageFull` when the disk filled; nothing is left at ``dest``."""
    if vm.state == VMState.DEAD or not vm.is_alive():
        raise SnapshotError(f"cannot snapshot {vm.id}: its QEMU is not running")
    try:
        result = await snapshot_running(vm, dest, labels, base, live=live)
    except LiveSnapshotError as exc:
        reason = exc.reason
        if isinstance(reason, SnapshotError | StorageFull) and not exc.snapshot_kept:
            raise reason from None
        raise SnapshotError(str(exc)) from exc
    return SnapshotFiles(result.dir, result.meta)
