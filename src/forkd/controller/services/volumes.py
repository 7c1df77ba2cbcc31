"""Volumes: create, describe and delete them; attach them to templates; collect layers."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from forkd.controller.models import VolumeAttach, VolumeInfo
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.received import receive_to
from forkd.disk_reserve import DiskReserve
from forkd.errors import Busy, Conflict, StorageFull
from forkd.limits import check_name
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.volumes.disks import (
    MAX_SIZE,
    Attachment,
    VolumeStore,
    attach_for_boot,
    parse_size,
)

if TYPE_CHECKING:
    from forkd.controller.services.holds import Holds
    from forkd.controller.services.live_vms import LiveVMs
    from forkd.controller.services.sandbox_vm import SandboxVM
    from forkd.controller.settings import Settings
    from forkd.controller.store import Store
    from forkd.vmm.pool import ForkPool

log = logging.getLogger(__name__)
MAX_RECEIVING = 2  # volume images arriving at once (each may be GiBs)


class VolumeService:
    def __init__(
        self,
        settings: Settings,
        db: Store,
        vms: LiveVMs,
        pool: ForkPool[SandboxVM],
        holds: Holds,
    ) -> None:
        """``db``: the daemon's records (the snapshots that hold a volume)."""
        self.settings = settings
        self.db = db
        self.vms = vms
        self.pool = pool
        self.holds = holds
        self.store = VolumeStore(
            self.settings.state_dir / "volumes", self.settings.disk_reserve_mib << 20
        )
        self.store.remove_dead_uploads()  # images a daemon that died was receiving
        self._receiving = 0  # volume images on their way in

    # ------------------------------------------------------------ users

    def _users(
        self, name: str, recorded: dict[str, tuple[Attachment, ...]] | None = None
    ) -> list[str]:
        if recorded is None:
            recorded = snapshot_files.recorded_volumes(self.settings.snapshot_root)
        users = [
            f"snapshot {row.tag}"
            for row in self.db.list_snapshots()
            if any(v.name == name for v in recorded.get(Path(row.dir).name, ()))
        ]
        for sid, vm in self.vms.items():
            if any(v.name == name for v in vm.volumes):
                users.append(f"sandbox {sid}")
        for dir_name, attached in recorded.items():  # asleep, its state on disk
            sleeper = HibernatedFiles.owner(dir_name)
            if sleeper and sleeper not in self.vms and any(v.name == name for v in attached):
                users.append(f"sandbox {sleeper} (hibernated)")
        return users

    def collect_layers(self) -> None:
        """Delete volume layers that no snapshot and no VM (or pooled QEMU) uses."""
        if self.holds.volume_layers_held() or self.pool.filling():
            return  # layers of work in progress are not registered yet; next time
        in_use: set[str] = set()
        for recorded in snapshot_files.recorded_volumes(self.settings.snapshot_root).values():
            for att in recorded:
                in_use.update(att.chain)
        for vm in self.vms.all_vms():
            for att in vm.volumes:
                in_use.update(att.chain)
        removed = self.store.collect(in_use)
        if removed:
            log.info("removed %d volume layers no snapshot or sandbox uses", removed)

    # ------------------------------------------------------------ attach

    def attach_for_boot(self, specs: Sequence[VolumeAttach]) -> list[Attachment]:
        """A template's attachments; on failure none is left behind."""
        attached: list[Attachment] = []
        try:
            for spec in specs:
                attached.append(attach_for_boot(self.store, spec.name, spec.path, spec.readonly))
        except BaseException:
            self.discard_unused(attached)
            raise
        return attached

    @staticmethod
    def discard_unused(attached: Sequence[Attachment]) -> None:
        """Delete the layers made for attachments no VM took."""
        for att in attached:
            if not att.readonly:
                Path(att.chain[0]).unlink(missing_ok=True)

    # ------------------------------------------------------------ routes

    def list(self) -> list[VolumeInfo]:
        recorded = snapshot_files.recorded_volumes(self.settings.snapshot_root)
        return [
            VolumeInfo(**v, used_by=self._users(v["name"], recorded)) for v in self.store.list()
        ]

    def info(self, name: str) -> VolumeInfo:
        check_name(name, "volume name")
        return VolumeInfo(**self.store.get(name), used_by=self._users(name))

    async def create(self, name: str, size: str, content: bytes) -> VolumeInfo:
        """An ext4 volume of ``size``; ``content``, a tar or tar.gz archive, fills it.

        The archive is unpacked from memory (the body limit bounds it) and
        within ``size`` (the store counts what it unpacks).
        """
        check_name(name, "volume name")
        nbytes = parse_size(size)
        if self.store.exists(name):
            raise Conflict(f"volume {name!r} already exists")
        info = await asyncio.to_thread(self.store.create, name, nbytes, content or None)
        return VolumeInfo(**info, used_by=[])

    async def import_image(self, name: str, body: AsyncIterator[bytes]) -> VolumeInfo:
        """A volume whose base is the ext4 image the client sends (the original forkd's
        ``--volume HOST_FILE.ext4:/mnt/data``): written as it arrives, within --disk-reserve
        and 1 TiB, checked to be ext4, then renamed into place; a failure keeps nothing."""
        check_name(name, "volume name")
        if self.store.exists(name):
            raise Conflict(f"volume {name!r} already exists")
        if self._receiving >= MAX_RECEIVING:
            raise Busy(f"{MAX_RECEIVING} volume images are arriving: retry shortly")
        reserve = DiskReserve(self.store.root, self.settings.disk_reserve_mib << 20)
        meter = reserve.meter(f"receiving volume {name}'s image")
        fd, path = self.store.upload_file()
        self._receiving += 1
        try:
            with os.fdopen(fd, "wb") as out:
                await receive_to(body, out, MAX_SIZE, meter, "an ext4 image")
            info = await asyncio.to_thread(self.store.create_from_image, name, path)
        except BaseException as exc:
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StorageFull(f"writing volume {name}'s image: {exc.strerror}") from exc
            raise
        finally:
            self._receiving -= 1
        return VolumeInfo(**info, used_by=[])

    async def delete(self, name: str) -> None:
        self.info(name)  # unknown or invalid first
        users = self._users(name)
        if self.holds.volume_layers_held():
            users.append("a template build or fork in progress")
        if users:
            raise Conflict(f"volume {name!r} is in use by {', '.join(users)}")
        await self.pool.drop_using(name)
        self.store.remove(name)
