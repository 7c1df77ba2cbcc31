"""A snapshot directory on disk, and the one reader and writer of its ``snapshot.json``.

``vmstate`` is QEMU's device and vCPU state without RAM (a few KiB);
``memory.bin`` is guest RAM as a sparse file, mapped privately by every VM
forked from it and never written after the snapshot is committed (a *diff*
snapshot has ``memory.diff`` and ``memory.runs`` instead: only the pages that
differ from its base snapshot, see :mod:`forkd.vmm.snapshot.memory_diff`);
``snapshot.json`` (:class:`SnapshotMeta`) records the machine, the image and
the volumes the snapshot needs, with figures of how it was taken. Nothing
else in forkd parses ``snapshot.json``: it asks this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd import __version__
from forkd.errors import SnapshotError
from forkd.vmm.qemu.argv import MachineConfig
from forkd.vmm.volumes.disks import Attachment

FORMAT = 1  # a full snapshot: what every forkd reads
DIFF_FORMAT = 2  # a diff snapshot: a forkd without diffs refuses it by its format
META = "snapshot.json"
VMSTATE = "vmstate"
MEMORY = "memory.bin"
MEMORY_DIFF = "memory.diff"
MEMORY_RUNS = "memory.runs"
MODES = ("full", "diff")


@dataclass(frozen=True)
class ImageRef:
    """The guest image a VM was booted from, as ``snapshot.json`` and ``vm.json`` name it."""

    name: str
    key: str | None
    dir: str | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "dir": self.dir}

    @classmethod
    def from_json(cls, data: Any) -> ImageRef | None:
        """``None`` for a record without one (``{}`` or ``null``)."""
        if not data:
            return None
        key, image_dir = data.get("key"), data.get("dir")
        return cls(
            str(data.get("name") or ""),
            None if key is None else str(key),
            None if image_dir is None else str(image_dir),
        )


def image_json(image: ImageRef | None) -> dict[str, Any]:
    """How a record writes its image: ``{}`` when it has none."""
    return image.to_json() if image is not None else {}


def new_id() -> str:
    """A new snapshot's id: what tells two snapshots that had the same tag apart."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class BaseRef:
    """A snapshot another one is a diff over: its tag, its directory and its id (``None``
    in records written before snapshots had ids: then only the tag is checked)."""

    tag: str
    dir: str
    id: str | None = None

    def to_json(self) -> dict[str, str]:
        data = {"tag": self.tag, "dir": self.dir}
        return data if self.id is None else {**data, "id": self.id}

    @classmethod
    def from_json(cls, data: Any) -> BaseRef:
        sid = data.get("id")
        return cls(str(data["tag"]), str(data["dir"]), None if sid is None else str(sid))


@dataclass(frozen=True)
class SnapshotLabels:
    """What the caller of a snapshot records beside what the VM driver knows."""

    tag: str | None = None
    branched_from: str | None = None  # the source sandbox's id, for a branch
    parent_tag: str | None = None
    pause_ms: float | None = None


@dataclass(frozen=True)
class SnapshotMeta:
    """The contents of ``snapshot.json``."""

    machine: MachineConfig
    image: ImageRef | None
    created_at_unix: int
    memory_bytes: int
    vmstate_bytes: int
    source_vm: str | None
    parent_snapshot: str | None
    capture_ms: float
    pages_written: int
    base_bytes_cloned: int
    tag: str | None = None
    branched_from: str | None = None
    parent_tag: str | None = None
    pause_ms: float | None = None
    volumes: tuple[Attachment, ...] = ()  # as the guest saw them at the pause, chains frozen
    forkd_version: str = __version__
    format: int = FORMAT
    mode: str = "full"  # "diff": only the pages that differ from ``base``
    base: BaseRef | None = None  # a diff's base snapshot
    chain: tuple[BaseRef, ...] = ()  # a diff's bases at the branch, the full root first
    # Unique per snapshot: kept by a compaction (same content), new for a copy.
    id: str | None = None
    parent_id: str | None = None  # the id of the snapshot its VM was forked from
    # Pages copied before the pause (a live snapshot); pages_written counts all.
    precopied_pages: int = 0

    @property
    def labels(self) -> SnapshotLabels:
        return SnapshotLabels(self.tag, self.branched_from, self.parent_tag, self.pause_ms)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "created_at_unix": self.created_at_unix,
            "forkd_version": self.forkd_version,
            "image": image_json(self.image),
            "machine": self.machine.to_json(),
            "memory_bytes": self.memory_bytes,
            "vmstate_bytes": self.vmstate_bytes,
            "source_vm": self.source_vm,
            "parent_snapshot": self.parent_snapshot,
            "capture_ms": self.capture_ms,
            "pages_written": self.pages_written,
            "base_bytes_cloned": self.base_bytes_cloned,
        }
        if self.precopied_pages:
            data["precopied_pages"] = self.precopied_pages
        # Labels are written only when the caller gave them, as always.
        labels = {
            "tag": self.tag,
            "branched_from": self.branched_from,
            "parent_tag": self.parent_tag,
            "pause_ms": self.pause_ms,
            "id": self.id,
            "parent_id": self.parent_id,
        }
        data.update({k: v for k, v in labels.items() if v is not None})
        data["volumes"] = [v.to_json() for v in self.volumes]
        if self.mode != "full":
            data["format"] = DIFF_FORMAT
            data["mode"] = self.mode
            data["base"] = self.base.to_json() if self.base else None
            data["chain"] = [link.to_json() for link in self.chain]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SnapshotMeta:
        """Read a record; keys it does not know are ignored, missing figures read as 0.

        Raises ``KeyError``, ``TypeError`` or ``ValueError`` on a malformed record.
        """
        machine = MachineConfig.from_json(data["machine"])
        return cls(
            machine=machine,
            image=ImageRef.from_json(data.get("image")),
            created_at_unix=int(data.get("created_at_unix") or 0),
            memory_bytes=int(data.get("memory_bytes") or machine.memory_mib << 20),
            vmstate_bytes=int(data.get("vmstate_bytes") or 0),
            source_vm=_opt_str(data.get("source_vm")),
            parent_snapshot=_opt_str(data.get("parent_snapshot")),
            capture_ms=float(data.get("capture_ms") or 0.0),
            pages_written=int(data.get("pages_written") or 0),
            base_bytes_cloned=int(data.get("base_bytes_cloned") or 0),
            tag=_opt_str(data.get("tag")),
            branched_from=_opt_str(data.get("branched_from")),
            parent_tag=_opt_str(data.get("parent_tag")),
            pause_ms=None if data.get("pause_ms") is None else float(data["pause_ms"]),
            volumes=_attachments(data.get("volumes")),
            forkd_version=str(data.get("forkd_version") or ""),
            format=int(data.get("format", FORMAT)),
            mode=str(data.get("mode") or "full"),
            base=BaseRef.from_json(data["base"]) if data.get("base") else None,
            chain=tuple(BaseRef.from_json(link) for link in data.get("chain") or []),
            id=_opt_str(data.get("id")),
            parent_id=_opt_str(data.get("parent_id")),
            precopied_pages=int(data.get("precopied_pages") or 0),
        )


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _attachments(data: Any) -> tuple[Attachment, ...]:
    return tuple(Attachment.from_json(v) for v in data or [])


@dataclass(frozen=True)
class SnapshotFiles:
    """A snapshot directory whose files were checked, and its record."""

    dir: Path
    meta: SnapshotMeta

    @property
    def vmstate(self) -> Path:
        return self.dir / VMSTATE

    @property
    def memory(self) -> Path:
        return self.dir / MEMORY

    @property
    def machine(self) -> MachineConfig:
        return self.meta.machine

    @property
    def is_diff(self) -> bool:
        return self.meta.mode == "diff"


def load(snap_dir: Path) -> SnapshotFiles:
    """Read and check a snapshot directory; errors name the file at fault."""
    meta_path = snap_dir / META
    if not snap_dir.is_dir():
        raise SnapshotError(f"snapshot directory {snap_dir} does not exist")
    try:
        raw = json.loads(meta_path.read_text())
        machine = MachineConfig.from_json(raw["machine"])
    except FileNotFoundError as exc:
        raise SnapshotError(f"{meta_path} is missing") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{meta_path} is unreadable or corrupt: {exc}") from exc
    want = DIFF_FORMAT if raw.get("mode") == "diff" else FORMAT
    if raw.get("format") != want:
        raise SnapshotError(f"{meta_path} has format {raw.get('format')!r}, expected {want}")
    try:
        meta = SnapshotMeta.from_json(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"{meta_path} is unreadable or corrupt: {exc}") from exc
    if meta.mode not in MODES or (meta.mode == "diff") != (meta.base is not None):
        raise SnapshotError(f"{meta_path} is corrupt: mode {meta.mode!r} with base {meta.base}")
    # The recorded size, when there is one: older records may lack it.
    _check_files(snap_dir, machine, raw.get("vmstate_bytes"), meta.mode == "diff")
    if meta.id is None:
        meta = dataclasses.replace(meta, id=legacy_id(meta_path, meta.created_at_unix))
    return SnapshotFiles(snap_dir, meta)


def legacy_id(meta_path: Path, created_at_unix: int) -> str:
    """The id of a snapshot recorded before ids: its ``snapshot.json``'s inode and its
    creation time, stable while that file is (a compaction writes the id down)."""
    return f"legacy-{meta_path.stat().st_ino:x}-{created_at_unix:x}"


def _check_files(snap_dir: Path, machine: MachineConfig, vmstate_bytes: Any, diff: bool) -> None:
    vmstate, memory = snap_dir / VMSTATE, snap_dir / (MEMORY_DIFF if diff else MEMORY)
    if diff and not (snap_dir / MEMORY_RUNS).is_file():
        raise SnapshotError(f"{snap_dir / MEMORY_RUNS} is missing: the snapshot cannot be restored")
    if not vmstate.is_file():
        raise SnapshotError(f"{vmstate} is missing: the snapshot cannot be restored")
    size = vmstate.stat().st_size
    if size == 0 or (vmstate_bytes is not None and vmstate_bytes != size):
        raise SnapshotError(f"{vmstate} is corrupt: {size} bytes, expected {vmstate_bytes}")
    if not memory.is_file():
        raise SnapshotError(f"{memory} is missing: the snapshot cannot be restored")
    want = machine.memory_mib << 20
    got = memory.stat().st_size
    if got != want:
        raise SnapshotError(f"{memory} is corrupt: {got} bytes, expected {want}")
    for path in machine.files():
        if not path.is_file():
            raise SnapshotError(f"the snapshot's image file {path} is missing")


def fsync_path(path: Path) -> None:
    """Flush a file or a directory (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(snap_dir: Path, meta: SnapshotMeta) -> Path:
    """Write ``snapshot.json`` into ``snap_dir`` (a staging directory); returns its path.

    The caller flushes it and renames the directory into place.
    """
    path = snap_dir / META
    path.write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    return path


# Readers of every snapshot directory under a root. Each skips directories
# whose record cannot be read, and reads only the key it needs, so one
# damaged file neither hides the others nor their use of an image or a layer.


def _records(root: Path) -> dict[str, dict[str, Any]]:
    """The raw ``snapshot.json`` of each directory under ``root``, staging ones too."""
    found: dict[str, dict[str, Any]] = {}
    if not root.is_dir():
        return found
    for d in root.iterdir():
        try:
            data = json.loads((d / META).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found[d.name] = data
    return found


def recorded_volumes(root: Path) -> dict[str, tuple[Attachment, ...]]:
    """The volumes (name, mount point, frozen chain) each snapshot under ``root`` records.

    Keyed by directory name. A staging directory counts as soon as its record
    is written, so layers of a snapshot being committed are never collected.
    """
    found: dict[str, tuple[Attachment, ...]] = {}
    for name, data in _records(root).items():
        try:
            found[name] = _attachments(data.get("volumes"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def recorded_images(root: Path) -> dict[str, ImageRef]:
    """The image each snapshot under ``root`` was made from, keyed by directory name."""
    found: dict[str, ImageRef] = {}
    for name, data in _records(root).items():
        try:
            image = ImageRef.from_json(data.get("image"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if image is not None:
            found[name] = image
    return found
