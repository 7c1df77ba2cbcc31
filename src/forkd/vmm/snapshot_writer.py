"""Writing one snapshot of a VM: staged beside its destination, renamed into place when whole.

The steps are split so the pause covers as little as possible (see
:mod:`forkd.vmm.vm`): :meth:`SnapshotWriter.prepare` clones the RAM file's
base while the VM runs, :meth:`~SnapshotWriter.capture` (VM paused) writes the
device state and the pages the guest wrote, :meth:`~SnapshotWriter.commit`
(VM running again) writes ``snapshot.json``, flushes and renames.

With a ``base`` (the snapshot the VM was forked from) the snapshot is a diff:
no clone, only the written pages that differ from the base's memory
(:mod:`forkd.vmm.memory_diff`), compared after the resume. With ``live`` a
full snapshot copies the written pages before the pause too, and the pause
only what changed since (:mod:`forkd.vmm.live_copy`), where the host can
track writes; elsewhere it is taken the pause-copy way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from forkd.errors import SnapshotError, StorageFull
from forkd.vmm import (
    live_copy,
    memory,
    memory_diff,
    snapshot_files,
    volume_mounts,
    write_tracking,
)
from forkd.vmm.launch import tail
from forkd.vmm.snapshot_files import BaseRef, SnapshotLabels, SnapshotMeta
from forkd.vmm.volumes import Attachment

if TYPE_CHECKING:
    from forkd.vmm.vm import VM

DEFERRED_WRITE_LIMIT = 1 << 30  # guest RAM held in memory between pause and commit

log = logging.getLogger(__name__)
T = TypeVar("T")


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


class SnapshotWriter:
    """A snapshot of one VM being built in a staging directory."""

    def __init__(
        self, vm: VM, dest: Path, base: BaseRef | None = None, *, live: bool = False
    ) -> None:
        self.vm = vm
        self.dest = dest
        self.base = base  # a diff over this snapshot; None: a full snapshot
        self.live = live and base is None  # copy before the pause where the host can
        self._live: live_copy.LiveCopy | None = None
        self._base_chain: memory_diff.Chain | None = None
        self._base_links: tuple[BaseRef, ...] = ()
        self._diff: memory_diff.DiffCapture | None = None
        self.staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(3)}"
        self.stats = memory.DumpStats()
        self.pause_started: float | None = None
        self.capture_ms: float | None = None
        self._mem_fd: int | None = None
        self._region: memory.RamRegion | None = None
        # Pages read during the pause, written after the resume (in commit).
        self._deferred = memory.DeferredWrites(limit=DEFERRED_WRITE_LIMIT)
        self.volumes: list[Attachment] = []  # as frozen for this snapshot
        # Handed to QEMU before the pause (it may not open forkd's files itself).
        self._vmstate_fdset: int | None = None
        self._layers: list[volume_mounts.NextLayer] = []
        # The worker thread copying pages now, if any: abort() waits for it before it
        # closes the descriptors it writes (a cancelled await leaves it running).
        self._busy: asyncio.Future[Any] | None = None

    async def _thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread, tracked for :meth:`abort`."""
        busy = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
        self._busy = busy
        return await asyncio.shield(busy)

    def _disk_full(self) -> StorageFull:
        return StorageFull(
            f"disk full while writing snapshot {self.dest.name} under {self.dest.parent}"
        )

    async def prepare(self) -> None:
        """Create the staging directory and clone the RAM file's base (VM may run)."""
        try:
            self.dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.staging.mkdir(mode=0o700)
            vm = self.vm
            size = vm.machine.memory_mib << 20
            self._region = memory.find_ram_region(vm.pid, vm.ram_file, size, vm.ram_inode)
            name = snapshot_files.MEMORY if self.base is None else snapshot_files.MEMORY_DIFF
            self._mem_fd = os.open(  # guest RAM: for the daemon's user only
                self.staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600
            )
            if self.base is None:
                self.stats = await self._thread(memory.clone_base, self._region, self._mem_fd)
                if self.live:
                    await self._precopy()
            else:
                await self._thread(self._open_base, size)
            # Descriptors of layers QEMU writes now: out of the sets, while the VM runs.
            await vm.qmp.release_writers()
            vmstate = self.staging / snapshot_files.VMSTATE
            os.close(os.open(vmstate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self._vmstate_fdset = await vm.qmp.add_fdset(vmstate, (os.O_WRONLY,))
            self._layers = await volume_mounts.prepare_layers(vm.qmp, vm.volumes)
        except BaseException as exc:
            await self.abort()
            raise await self._translate(exc, "preparing") from exc

    async def _precopy(self) -> None:
        """Copy the written pages now, while the VM runs (see :mod:`live_copy`)."""
        assert self._region is not None and self._mem_fd is not None
        reason = write_tracking.problem()
        if reason is not None:
            log.debug("live snapshot of %s taken with a pause-copy: %s", self.vm.id, reason)
            return
        vm, region = self.vm, self._region
        try:
            vm.write_tracker = await self._thread(
                live_copy.tracker_for, vm.pid, region, vm.write_tracker
            )
        except OSError as exc:
            log.warning("cannot track the writes of %s (%s): pause-copy instead", vm.id, exc)
            return
        copy = live_copy.LiveCopy(
            vm.write_tracker,
            region,
            self._mem_fd,
            base_is_empty=self.stats.base_bytes_cloned == 0,
            stats=self.stats,
        )
        await self._thread(copy.precopy)
        self._live = copy

    def _open_base(self, size: int) -> None:
        """Open the base's chain (held by descriptors: a compaction may swap its files)."""
        assert self.base is not None and self._mem_fd is not None
        origin, base = self.vm.origin, self.base
        if (
            origin is None
            or os.path.realpath(origin) != os.path.realpath(base.dir)
            or base.id is None
            or self.vm.origin_id != base.id
        ):
            raise SnapshotError(f"{self.vm.id} was not forked from {base.tag!r}: no diff over it")
        base_files = snapshot_files.load(Path(base.dir))
        if base_files.meta.id != base.id:  # its tag was deleted and made again
            raise SnapshotError(f"{base.tag!r} was replaced since {self.vm.id} was forked from it")
        self._base_chain = memory_diff.resolve(base_files)
        self._base_links = (*base_files.meta.chain, self.base)
        os.ftruncate(self._mem_fd, size)
        self._diff = memory_diff.DiffCapture(self._mem_fd, limit=DEFERRED_WRITE_LIMIT)

    async def capture(self) -> None:
        """Write vmstate and the guest's written pages. The VM must be paused."""
        vm = self.vm
        assert self._region is not None and self._mem_fd is not None
        started = time.monotonic()
        try:
            self.volumes = await vm.freeze_volumes(self._layers)
            await vm.qmp.execute(
                "xen-save-devices-state",
                {"filename": f"/dev/fdset/{self._vmstate_fdset}", "live": False},
            )
            if self._diff is not None:
                await self._thread(self._diff.capture, self._region)
            elif self._live is not None:
                await self._thread(self._live.capture, self._deferred)
            else:
                await self._thread(
                    memory.dump_written_pages,
                    self._region,
                    self._mem_fd,
                    base_is_empty=self.stats.base_bytes_cloned == 0,
                    stats=self.stats,
                    defer=self._deferred,
                )
        except BaseException as exc:
            raise await self._translate(exc, "capturing") from exc
        self.capture_ms = (time.monotonic() - started) * 1000

    async def _translate(self, exc: BaseException, step: str) -> BaseException:
        if not isinstance(exc, Exception):
            return exc
        vm = self.vm
        if _is_disk_full(exc):  # the VM is fine
            return self._disk_full()
        # Anything else may be QEMU dying (SIGKILL): give it a moment to be gone.
        if await vm.gone(wait=0.5):  # marks it dead
            return SnapshotError(
                f"QEMU of {vm.id} died while {step} the snapshot {self.dest.name}: "
                f"{tail(vm.rt.qemu_log, 500) or exc}"
            )
        if isinstance(exc, (SnapshotError, StorageFull)):
            return exc
        return SnapshotError(f"{step} snapshot {self.dest.name} of {vm.id} failed: {exc}")

    def _meta(self, labels: SnapshotLabels) -> SnapshotMeta:
        vm = self.vm
        return SnapshotMeta(
            machine=vm.machine,
            image=vm.image,
            created_at_unix=int(time.time()),
            memory_bytes=vm.machine.memory_mib << 20,
            vmstate_bytes=(self.staging / snapshot_files.VMSTATE).stat().st_size,
            source_vm=vm.id,
            parent_snapshot=str(vm.origin) if vm.origin else None,
            parent_id=vm.origin_id,
            id=snapshot_files.new_id(),
            capture_ms=round(self.capture_ms or 0.0, 1),
            pages_written=self.stats.pages_written,
            precopied_pages=self._live.precopy_pages if self._live is not None else 0,
            base_bytes_cloned=self.stats.base_bytes_cloned,
            tag=labels.tag,
            branched_from=labels.branched_from,
            parent_tag=labels.parent_tag,
            pause_ms=labels.pause_ms,
            # What the guest saw at the pause: name, mount point, mode, frozen chain.
            volumes=tuple(self.volumes),
            mode="full" if self.base is None else "diff",
            base=self.base,
            chain=self._base_links,
        )

    async def commit(self, labels: SnapshotLabels | None = None) -> SnapshotMeta:
        """Write snapshot.json, flush, and rename the staging directory to ``dest``."""
        try:
            assert self._mem_fd is not None
            await self._release_qemu_files()
            if self._diff is not None:
                assert self._base_chain is not None
                runs = self.staging / snapshot_files.MEMORY_RUNS
                await self._thread(self._diff.finish, self._base_chain, runs)
                self.stats.pages_written = self._diff.pages_kept
                runs.chmod(0o600)
            else:
                await self._thread(
                    self._deferred.flush,
                    self._mem_fd,
                    # After a precopy a zero page may overwrite a copied one.
                    base_is_empty=self.stats.base_bytes_cloned == 0 and self._live is None,
                    stats=self.stats,
                )
                if self._live is not None:
                    await self._thread(self._live.finish)
            await self._thread(os.fsync, self._mem_fd)
            os.close(self._mem_fd)
            self._mem_fd = None
            meta = self._meta(labels or SnapshotLabels())
            meta_path = snapshot_files.write_meta(self.staging, meta)
            # QEMU wrote vmstate and write_meta snapshot.json with the process
            # umask's modes: narrow both to the daemon's user.
            for path in (self.staging / snapshot_files.VMSTATE, meta_path):
                path.chmod(0o600)
            for path in (self.staging / snapshot_files.VMSTATE, meta_path, self.staging):
                snapshot_files.fsync_path(path)
            self.staging.rename(self.dest)
            snapshot_files.fsync_path(self.dest.parent)
            self._close_base()
        except BaseException as exc:
            await self.abort()
            if _is_disk_full(exc):
                raise self._disk_full() from exc
            raise
        return meta

    async def _release_qemu_files(self) -> None:
        """Give back the fd sets; delete the prepared layers QEMU did not take."""
        if self._vmstate_fdset is None and not self._layers:
            return
        qmp = self.vm.qmp
        if self._vmstate_fdset is not None:
            await qmp.remove_fdset(self._vmstate_fdset)
            self._vmstate_fdset = None
        layers, self._layers = self._layers, []
        await volume_mounts.discard_layers(qmp, layers)

    def _close_base(self) -> None:
        if self._base_chain is not None:
            self._base_chain.close()
            self._base_chain = None
        self._diff = None

    async def abort(self) -> None:
        """Remove everything this snapshot wrote."""
        if self._busy is not None and not self._busy.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait({self._busy})
        await self._release_qemu_files()
        self._deferred.runs.clear()
        self._close_base()
        if self._mem_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._mem_fd)
            self._mem_fd = None
        await asyncio.to_thread(shutil.rmtree, self.staging, True)
