"""A snapshot's volumes as registry pieces: each attachment's disk as it was at the
snapshot, flattened to raw and cut in 1 MiB chunks (holes and zero chunks left out).

A writable attachment's frozen chain (qcow2 layers over the volume's raw
``base.img``) is read through ``qemu-img convert`` into a sparse raw file in
a scratch directory; a read-only one is its ``base.img`` itself. On the far
side each becomes a new volume whose base is that content, so a fork there
gets its own layer over it, as over any snapshot's volume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forkd import hosttools, limits
from forkd.errors import UpstreamError
from forkd.oci import artifact
from forkd.oci.artifact import Manifest
from forkd.vmm.snapshot import memory
from forkd.vmm.volumes.disks import MAX_SIZE, MIN_SIZE, Attachment, VolumeInvalid, check_guest_mount


def part(index: int) -> str:
    return f"volume.{index}"


def raw_disk(att: Attachment, scratch: Path, index: int) -> Path:
    """The attachment's disk as one raw file: its base itself, or its chain flattened."""
    if att.format == "raw":
        return att.top
    out = scratch / f"volume-{index}.raw"
    hosttools.run(
        ["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", str(att.top), str(out)],
        what=f"reading volume {att.name}",
    )
    return out


def chunks(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(offset, data)`` of each non-zero chunk of ``path``, skipping holes."""
    step = artifact.MEMORY_CHUNK
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        done = 0  # chunks before this offset were read already
        for data, hole in memory.data_extents(fd, size):
            for off in range(max(data - data % step, done), hole, step):
                piece = os.pread(fd, min(step, size - off), off)
                if piece.count(0) != len(piece):
                    yield off, piece
                done = off + step
    finally:
        os.close(fd)


def wanted(manifest: Manifest, config: dict[str, Any]) -> list[dict[str, Any]]:
    """The volumes a config lists, each checked: a name, a mount point, a size."""
    found = []
    listed = config.get("volumes") or []
    if not isinstance(listed, list) or len(listed) > limits.MAX_VOLUMES_PER_VM:
        raise UpstreamError(f"the snapshot lists more than {limits.MAX_VOLUMES_PER_VM} volumes")
    for i, vol in enumerate(listed):
        try:
            name, path, size = str(vol["name"]), str(vol["path"]), int(vol["size_bytes"])
            check_guest_mount(path)
        except (KeyError, TypeError, ValueError, VolumeInvalid) as exc:
            raise UpstreamError(f"the snapshot lists a volume forkd refuses: {exc}") from exc
        if not limits.NAME_RE.fullmatch(name) or not MIN_SIZE <= size <= MAX_SIZE:
            raise UpstreamError(f"the snapshot lists volume {name!r} of {size} bytes")
        artifact.check_placed(
            manifest.of_part(part(i)), artifact.VOLUME_TYPE, f"volume {name!r}", limit=size
        )
        found.append(
            {
                "name": name,
                "path": path,
                "readonly": bool(vol.get("readonly")),
                "size_bytes": size,
                "part": part(i),
            }
        )
    return found


def write(remote_manifest: Manifest, volume: dict[str, Any], pieces: Any, fd: int) -> None:
    """Volume ``volume``'s disk into ``fd`` (an empty file), zero pages left as holes;
    ``pieces(layers)`` yields each layer with its checked, uncompressed content."""
    os.ftruncate(fd, volume["size_bytes"])
    for layer, data in pieces(remote_manifest.of_part(volume["part"])):
        memory.write_nonzero(fd, data, layer.offset)
