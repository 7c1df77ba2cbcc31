"""What a pull writes (:meth:`SnapshotTransfer.pull
<forkd.controller.services.snapshot_transfer.SnapshotTransfer.pull>`, in a transfer
thread): the plan, checked against this host before anything is written (409 naming
every mismatch; 507 when the registry's claim cannot fit); then the snapshot's files in
its staging directory, the image first when this host lacks it, and its volumes. What
it made outside the staging directory is listed, to be removed if the pull fails."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd import accel, paths
from forkd.controller.services import transfer_records
from forkd.controller.settings import Settings
from forkd.disk_reserve import free_bytes
from forkd.errors import Conflict, Invalid, NoRoom, UpstreamError
from forkd.guest import pulled_image
from forkd.oci import artifact, host_needs, image_files, pull, volume_files
from forkd.oci.pull import Downloads, Remote
from forkd.oci.repository import PullSource
from forkd.vmm.jail import egress
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot.files import SnapshotFiles
from forkd.vmm.snapshot.memory_diff import Chain
from forkd.vmm.volumes.disks import Attachment, VolumeStore

PULL_RESERVE_BYTES = 256 << 20  # a pull leaves this much of the disk free


def plan(remote: Remote, settings: Settings, root: Path) -> Plan:
    """Every reason this host cannot restore ``remote`` (409 naming them all); else
    what the pull will write."""
    kvm = accel.choose(settings.accel).name == "kvm"
    problems = host_needs.mismatches(remote.config["needs"], kvm)
    machine, needs = remote.config["machine"], remote.config["needs"]
    for key in ("memory_mib", "vcpus", "accel"):  # the checked needs are the machine
        if machine.get(key) != needs.get(key):
            problems.append(f"its machine and its needs disagree on {key}")
    if machine.get("memory_mib") != remote.memory_bytes >> 20:
        problems.append("its machine and its memory disagree on the guest's size")
    try:
        egress.of_machine(machine.get("egress"), bool(machine.get("internet", True)))
    except Invalid as exc:
        problems.append(f"its egress policy is invalid here: {exc}")
    volumes = volume_files.wanted(remote.manifest, remote.config)  # malformed: 502
    files = image_files.wanted(remote.manifest, artifact.image_file_names(remote.config))
    try:
        image_meta = pulled_image.checked(remote.config["image"].get("meta") or {})
    except pulled_image.PulledImageInvalid as exc:
        raise UpstreamError(f"{remote.where} is not a snapshot this forkd can use: {exc}") from exc
    image_dir = image_files.local_dir(paths.images_dir(), remote.config, files)
    if problems:
        why = "; ".join(problems)
        raise Conflict(f"{remote.where} cannot be restored on this host: {why}")
    image_bytes = 0 if image_dir else sum(n for f in files.values() for _o, n, _d in f)
    reserve = max(PULL_RESERVE_BYTES, settings.disk_reserve_mib << 20)
    need = image_bytes + sum(v["size_bytes"] for v in volumes)
    _check_room(root, remote, need, reserve)
    return Plan(image_dir, files, image_meta, volumes)


def write(
    registry: PullSource,
    remote: Remote,
    downloads: Downloads,
    staging: Path,
    plan: Plan,
    made: Made,
    chain_of: Callable[[str], Chain | None],
    volume_store: VolumeStore,
) -> SnapshotFiles:
    """The snapshot's files in ``staging`` (in a thread); the image first if missing."""
    image_dir = plan.image_dir
    if image_dir is None:
        image_dir = image_files.install(
            paths.images_dir(),
            remote.config,
            plan.image_pieces,
            downloads.fetch,
            plan.image_meta,
        )
        made.images.append(image_dir)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(staging / snapshot_files.VMSTATE, flags, 0o600)
    try:
        vmstate_bytes = pull.write_vmstate(remote, downloads, fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(staging / snapshot_files.MEMORY, flags, 0o600)
    try:
        pull.write_memory(registry, remote, downloads, fd, chain_of)
        os.fsync(fd)
    finally:
        os.close(fd)
    attachments = _write_volumes(remote, plan.volumes, downloads, made, volume_store)
    meta = transfer_records.pulled_meta(remote, image_dir, vmstate_bytes, attachments)
    snapshot_files.fsync_path(snapshot_files.write_meta(staging, meta))
    return SnapshotFiles(staging, meta)


def _write_volumes(
    remote: Remote,
    volumes: list[dict[str, Any]],
    downloads: Downloads,
    made: Made,
    store: VolumeStore,
) -> tuple[Attachment, ...]:
    """Each volume the snapshot carries, as a new volume of this daemon (its name, or
    the name with a suffix when taken); they go again if the pull fails."""
    attachments = []
    for vol in volumes:

        def fill(fd: int, vol: dict[str, Any] = vol) -> None:
            volume_files.write(remote.manifest, vol, downloads.pieces, fd)

        name = store.create_filled(vol["name"], vol["size_bytes"], fill)
        made.volumes.append(name)
        base = (str(store.base(name)),)
        attachments.append(Attachment(name, vol["path"], vol["readonly"], base))
    return tuple(attachments)


@dataclass(frozen=True)
class Plan:
    """What a checked pull will write: the image directory it uses (``None``: the
    image's pieces are pulled too) and the volumes it makes."""

    image_dir: Path | None
    image_pieces: dict[str, list[image_files.Piece]]
    image_meta: dict[str, Any]  # a pulled image's image.json (checked)
    volumes: list[dict[str, Any]]


@dataclass
class Made:
    """What a pull made outside its staging directory: removed again if it fails."""

    volumes: list[str] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)

    def remove(self, store: VolumeStore) -> None:
        for name in self.volumes:
            with contextlib.suppress(Exception):
                store.remove(name)
        for image_dir in self.images:
            shutil.rmtree(image_dir, ignore_errors=True)


def _check_room(root: Path, remote: Remote, other_bytes: int, reserve: int) -> None:
    """The most a pull can write (its memory, device state, image and volumes, all
    allocated) must fit on the disk, with the reserve left: a registry's claim of a huge
    image or volume is refused before anything is written (507)."""
    vmstate = sum(la.length for la in remote.manifest.of_part("vmstate"))
    need = remote.memory_bytes + vmstate + other_bytes
    free = free_bytes(root) - reserve
    if need > free:
        raise NoRoom(
            f"pulling {remote.where} may need {need >> 20} MiB on disk and "
            f"{max(free, 0) >> 20} MiB are free (beside a {reserve >> 20} MiB reserve, "
            "--disk-reserve)"
        )
