"""What a snapshot's artifact says of it, both ways: the config a push sends (without host
paths, its image files by name, its format the oldest that can carry it) and the
``snapshot.json`` record a pulled snapshot gets here (this host's image files, a new id).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forkd import limits
from forkd.controller.store_rows import SnapshotRow, now
from forkd.errors import Conflict, UpstreamError
from forkd.oci import artifact, host_needs, image_files, pull
from forkd.vmm.qemu.argv import MachineConfig
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot.files import ImageRef, SnapshotFiles, SnapshotMeta
from forkd.vmm.volumes.disks import Attachment

# A machine's files on this host: not sent (the image's files travel by name instead).
HOST_PATHS = ("vmlinuz", "initrd", "rootfs", "runtime")


def pushed_tag(config: dict[str, Any]) -> str | None:
    tag = config["snapshot"].get("tag")
    return tag if isinstance(tag, str) and limits.NAME_RE.fullmatch(tag) else None


def image_file_names(machine: MachineConfig) -> tuple[str, ...]:
    """The image files a snapshot's machine boots from, by their names in its image
    directory (where a push reads them); :class:`Conflict` when one lies elsewhere."""
    image_dir = machine.rootfs.parent
    named = {
        "vmlinuz": machine.vmlinuz,
        "initrd.img": machine.initrd,
        "rootfs.sqfs": machine.rootfs,
    }
    if machine.runtime is not None:
        named[artifact.RUNTIME_FILE] = machine.runtime
    for name, path in named.items():
        if path != image_dir / name:
            raise Conflict(f"the snapshot's {name} is not in its image directory {image_dir}")
    return tuple(named)


def config(files: SnapshotFiles, row: SnapshotRow) -> dict[str, Any]:
    """A snapshot's config blob, but its memory (the push adds that). Format 1 unless its
    image has files format 1 cannot carry (a container image's runtime disk)."""
    meta, machine = files.meta, files.machine
    image = meta.image
    image_meta = image_files.local_meta(machine.rootfs.parent)
    names = image_file_names(machine)
    version = artifact.config_format(names)
    return {
        "format": version,
        "snapshot": {
            "tag": row.tag,
            "id": meta.id,
            "parent_id": meta.parent_id,
            "parent_tag": meta.parent_tag,
            "created_at_unix": meta.created_at_unix,
            "pause_ms": meta.pause_ms,
            "capture_ms": meta.capture_ms,
            "pages_written": meta.pages_written,
            "forkd_version": meta.forkd_version,
            "metadata": row.metadata,
        },
        "machine": {k: v for k, v in machine.to_json().items() if k not in HOST_PATHS},
        "image": {  # the build whose files go with it: its image.json says which
            "name": image_meta.get("name") or (image.name if image else None),
            "key": image_meta.get("key") or (image.key if image else None),
            "meta": image_meta,
            **({"files": list(names)} if version > 1 else {}),
        },
        "needs": host_needs.of_machine(machine),
        "vmstate_bytes": meta.vmstate_bytes,
    }


def pulled_meta(
    remote: pull.Remote, image_dir: Path, vmstate_bytes: int, volumes: tuple[Attachment, ...]
) -> SnapshotMeta:
    """The record of a pulled snapshot: its machine on this host's image files, a new id.
    No path of the config is used: a runtime disk is the pulled image's, when it has one."""
    conf, snap = remote.config["machine"], remote.config["snapshot"]
    name, key = image_files.image_dir_name(remote.config)
    carried = artifact.image_file_names(remote.config)
    try:
        machine = MachineConfig.from_json(
            {
                **{k: v for k, v in conf.items() if k not in HOST_PATHS},
                "vmlinuz": str(image_dir / "vmlinuz"),
                "initrd": str(image_dir / "initrd.img"),
                "rootfs": str(image_dir / "rootfs.sqfs"),
                "runtime": (
                    str(image_dir / artifact.RUNTIME_FILE)
                    if artifact.RUNTIME_FILE in carried
                    else None
                ),
            }
        )
        return SnapshotMeta(
            machine=machine,
            image=ImageRef(name, key, str(image_dir)),
            created_at_unix=int(snap.get("created_at_unix") or now()),
            memory_bytes=remote.memory_bytes,
            vmstate_bytes=vmstate_bytes,
            source_vm=None,
            parent_snapshot=None,
            capture_ms=float(snap.get("capture_ms") or 0.0),
            pages_written=int(snap.get("pages_written") or 0),
            base_bytes_cloned=0,
            pause_ms=None if snap.get("pause_ms") is None else float(snap["pause_ms"]),
            volumes=volumes,
            id=snapshot_files.new_id(),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UpstreamError(f"{remote.where} has a malformed machine: {exc}") from exc
