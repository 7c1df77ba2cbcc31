"""Writing one snapshot of a VM: staged beside its destination, renamed into place when whole.

The steps are split so the pause covers as little as possible (see
:mod:`forkd.vmm.snapshot.live`): :meth:`SnapshotWriter.prepare` stages the
files while the VM runs, :meth:`~SnapshotWriter.capture` (VM paused) writes the
device state and reads the guest's memory, :meth:`~SnapshotWriter.commit` (VM
running again) finishes the memory, writes ``snapshot.json``, flushes and
renames.

How the memory is written (full, ``live`` or a diff over ``base``) is its
strategy's (:mod:`forkd.vmm.snapshot.memory_strategy`), chosen once; the writer keeps
the staging directory, the device state, the volumes, QEMU's fd sets and the
errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from forkd.errors import SnapshotError, StorageFull
from forkd.vmm.qemu.argv import MachineConfig
from forkd.vmm.qemu.launch import tail
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory, memory_strategy
from forkd.vmm.snapshot.files import BaseRef, ImageRef, SnapshotLabels, SnapshotMeta
from forkd.vmm.volumes import mounts as volume_mounts
from forkd.vmm.volumes.disks import Attachment

T = TypeVar("T")


class SnapshotChannel(volume_mounts.FdSets, Protocol):
    """What a snapshot asks of QEMU (:class:`forkd.vmm.qemu.qmp.QMPChannel`)."""

    async def release_writers(self) -> None: ...
    async def save_device_state(self, fdset: int) -> None: ...


class QemuLog(Protocol):
    @property
    def qemu_log(self) -> Path: ...


class SnapshotSource(memory_strategy.MemorySource, Protocol):
    """The VM a snapshot is written of (:class:`forkd.vmm.vm.VM`), as far as the writer
    reads and drives it."""

    @property
    def machine(self) -> MachineConfig: ...
    @property
    def image(self) -> ImageRef | None: ...
    @property
    def ram_file(self) -> Path: ...
    @property
    def ram_inode(self) -> int | None: ...
    @property
    def volumes(self) -> Sequence[Attachment]: ...
    @property
    def rt(self) -> QemuLog: ...
    @property
    def qmp(self) -> SnapshotChannel: ...

    async def freeze_volumes(
        self, prepared: Sequence[volume_mounts.NextLayer]
    ) -> list[Attachment]: ...
    async def gone(self, wait: float = ...) -> bool: ...


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


class SnapshotWriter:
    """A snapshot of one VM being built in a staging directory."""

    def __init__(
        self, vm: SnapshotSource, dest: Path, base: BaseRef | None = None, *, live: bool = False
    ) -> None:
        self.vm = vm
        self.dest = dest
        self.staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(3)}"
        self.pause_started: float | None = None
        self.capture_ms: float | None = None
        # The worker thread copying pages now, if any: abort() waits for it before it
        # closes the descriptors it writes (a cancelled await leaves it running).
        self._busy: asyncio.Future[Any] | None = None
        # base: a diff over it; else full, live: copied before the pause where the host can.
        self.memory_strategy = memory_strategy.for_snapshot(
            vm, base, live=live, thread=self._thread
        )
        self._mem_fd: int | None = None  # the memory file, written by its strategy
        self._region: memory.RamRegion | None = None
        self.volumes: list[Attachment] = []  # as frozen for this snapshot
        # Handed to QEMU before the pause (it may not open forkd's files itself).
        self._vmstate_fdset: int | None = None
        self._layers: list[volume_mounts.NextLayer] = []

    @property
    def stats(self) -> memory.DumpStats:
        """What the memory's strategy copied so far."""
        return self.memory_strategy.stats

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
        """Create the staging directory and prepare the memory file (VM may run)."""
        try:
            self.dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.staging.mkdir(mode=0o700)
            vm = self.vm
            size = vm.machine.memory_mib << 20
            self._region = memory.find_ram_region(vm.pid, vm.ram_file, size, vm.ram_inode)
            self._mem_fd = os.open(  # guest RAM: for the daemon's user only
                self.staging / self.memory_strategy.file_name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                0o600,
            )
            await self.memory_strategy.prepare(self._region, self._mem_fd)
            # Descriptors of layers QEMU writes now: out of the sets, while the VM runs.
            await vm.qmp.release_writers()
            vmstate = self.staging / snapshot_files.VMSTATE
            os.close(os.open(vmstate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self._vmstate_fdset = await vm.qmp.add_fdset(vmstate, (os.O_WRONLY,))
            self._layers = await volume_mounts.prepare_layers(vm.qmp, vm.volumes)
        except BaseException as exc:
            await self.abort()
            raise await self._translate(exc, "preparing") from exc

    async def capture(self) -> None:
        """Write vmstate and the guest's written pages. The VM must be paused."""
        vm = self.vm
        assert self._region is not None and self._mem_fd is not None
        started = time.monotonic()
        try:
            self.volumes = await vm.freeze_volumes(self._layers)
            assert self._vmstate_fdset is not None  # set by prepare()
            await vm.qmp.save_device_state(self._vmstate_fdset)
            await self.memory_strategy.capture(self._region, self._mem_fd)
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
        vm, mem = self.vm, self.memory_strategy.record()
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
            pages_written=mem.pages_written,
            precopied_pages=mem.precopied_pages,
            base_bytes_cloned=mem.base_bytes_cloned,
            tag=labels.tag,
            branched_from=labels.branched_from,
            parent_tag=labels.parent_tag,
            pause_ms=labels.pause_ms,
            # What the guest saw at the pause: name, mount point, mode, frozen chain.
            volumes=tuple(self.volumes),
            mode=mem.mode,
            base=mem.base,
            chain=mem.chain,
        )

    async def commit(self, labels: SnapshotLabels | None = None) -> SnapshotMeta:
        """Write snapshot.json, flush, and rename the staging directory to ``dest``."""
        try:
            assert self._mem_fd is not None
            await self._release_qemu_files()
            await self.memory_strategy.finish(self._mem_fd, self.staging)
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
            self.memory_strategy.close()
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

    async def abort(self) -> None:
        """Remove everything this snapshot wrote."""
        if self._busy is not None and not self._busy.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait({self._busy})
        await self._release_qemu_files()
        self.memory_strategy.close()
        if self._mem_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._mem_fd)
            self._mem_fd = None
        await asyncio.to_thread(shutil.rmtree, self.staging, True)
