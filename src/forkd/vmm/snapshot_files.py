"""A snapshot directory on disk: ``snapshot.json``, ``vmstate``, ``memory.bin``.

``vmstate`` is QEMU's device and vCPU state without RAM (a few KiB);
``memory.bin`` is guest RAM as a sparse file, mapped privately by every VM
forked from it and never written after the snapshot is committed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.errors import SnapshotError
from forkd.vmm.qemu_argv import MachineConfig

FORMAT = 1
META = "snapshot.json"
VMSTATE = "vmstate"
MEMORY = "memory.bin"


@dataclass(frozen=True)
class SnapshotFiles:
    dir: Path
    meta: dict[str, Any]

    @property
    def vmstate(self) -> Path:
        return self.dir / VMSTATE

    @property
    def memory(self) -> Path:
        return self.dir / MEMORY

    @property
    def machine(self) -> MachineConfig:
        return MachineConfig.from_json(self.meta["machine"])


def load(snap_dir: Path) -> SnapshotFiles:
    """Read and check a snapshot directory; errors name the file at fault."""
    meta_path = snap_dir / META
    if not snap_dir.is_dir():
        raise SnapshotError(f"snapshot directory {snap_dir} does not exist")
    try:
        meta = json.loads(meta_path.read_text())
        machine = MachineConfig.from_json(meta["machine"])
    except FileNotFoundError as exc:
        raise SnapshotError(f"{meta_path} is missing") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{meta_path} is unreadable or corrupt: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT}")
    files = SnapshotFiles(snap_dir, meta)
    check_files(files, machine)
    return files


def check_files(files: SnapshotFiles, machine: MachineConfig) -> None:
    vmstate, memory = files.vmstate, files.memory
    if not vmstate.is_file():
        raise SnapshotError(f"{vmstate} is missing: the snapshot cannot be restored")
    size = vmstate.stat().st_size
    expected = files.meta.get("vmstate_bytes")
    if size == 0 or (expected is not None and expected != size):
        raise SnapshotError(f"{vmstate} is corrupt: {size} bytes, expected {expected}")
    if not memory.is_file():
        raise SnapshotError(f"{memory} is missing: the snapshot cannot be restored")
    want = machine.memory_mib << 20
    got = memory.stat().st_size
    if got != want:
        raise SnapshotError(f"{memory} is corrupt: {got} bytes, expected {want}")
    for path in (machine.vmlinuz, machine.initrd, machine.rootfs):
        if not path.is_file():
            raise SnapshotError(f"the snapshot's image file {path} is missing")
