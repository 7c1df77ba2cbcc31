"""The one reader and writer of ``vm.json``, a running VM's record in its run directory.

A daemon that restarts adopts its detached VMs from this record
(:meth:`forkd.vmm.vm.VM.adopt`); the image builder asks it which images
running VMs still use.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkd.errors import VMError
from forkd.vmm.jail.cgroups import Group
from forkd.vmm.jail.network import SandboxNet
from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths
from forkd.vmm.snapshot.files import ImageRef, image_json
from forkd.vmm.volumes.disks import Attachment

if TYPE_CHECKING:
    from forkd.vmm.vm import VM

META = "vm.json"  # RuntimePaths.meta


@dataclass(frozen=True)
class VMRecord:
    """The contents of ``vm.json``."""

    id: str
    pid: int
    qmp: Path
    agent: Path
    ram_file: Path
    origin_snapshot: Path | None  # the snapshot directory a fork was made from
    machine: MachineConfig
    image: ImageRef | None
    started_at_unix: float
    volumes: tuple[Attachment, ...] = ()
    network: SandboxNet | None = None  # its namespace, when it has one
    cgroup: Group | None = None  # its cgroup, when the host has them
    origin_id: str | None = None  # the id of the snapshot it was forked from

    def to_json(self) -> dict[str, Any]:
        data = {
            "id": self.id,
            "pid": self.pid,
            "qmp": str(self.qmp),
            "agent": str(self.agent),
            "ram_file": str(self.ram_file),
            "origin_snapshot": str(self.origin_snapshot) if self.origin_snapshot else None,
            "machine": self.machine.to_json(),
            "image": image_json(self.image),
            "started_at_unix": self.started_at_unix,
            "volumes": [v.to_json() for v in self.volumes],
            "origin_id": self.origin_id,
        }
        if self.network is not None:
            data["network"] = self.network.to_json()
        if self.cgroup is not None:
            data["cgroup"] = self.cgroup.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], rt: RuntimePaths) -> VMRecord:
        """Raises ``KeyError``, ``TypeError`` or ``ValueError`` on a malformed record."""
        origin = data.get("origin_snapshot")
        return cls(
            id=str(data["id"]),
            pid=int(data["pid"]),
            qmp=Path(data.get("qmp") or rt.qmp),
            agent=Path(data.get("agent") or rt.agent),
            ram_file=Path(data["ram_file"]),
            origin_snapshot=Path(origin) if origin else None,
            machine=MachineConfig.from_json(data["machine"]),
            image=ImageRef.from_json(data.get("image")),
            started_at_unix=float(data.get("started_at_unix", time.time())),
            volumes=tuple(Attachment.from_json(v) for v in data.get("volumes") or []),
            network=SandboxNet.from_json(data["network"]) if data.get("network") else None,
            cgroup=Group.from_json(data.get("cgroup")),
            origin_id=None if data.get("origin_id") is None else str(data["origin_id"]),
        )


def write(rt: RuntimePaths, record: VMRecord) -> None:
    """Replace ``vm.json`` in one step: a reader sees the old record or the new one."""
    tmp = rt.meta.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    tmp.replace(rt.meta)


def read(rt: RuntimePaths) -> VMRecord:
    """The record in ``rt``'s run directory; :class:`VMError` naming the file otherwise."""
    try:
        return VMRecord.from_json(json.loads(rt.meta.read_text()), rt)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise VMError(f"cannot read {rt.meta}: {exc}") from exc


def recorded_images(run_root: Path) -> dict[str, ImageRef]:
    """The image each VM under ``run_root`` runs, keyed by run directory name.

    Directories without a readable record are skipped.
    """
    found: dict[str, ImageRef] = {}
    if not run_root.is_dir():
        return found
    for d in run_root.iterdir():
        try:
            data = json.loads((d / META).read_text())
            image = ImageRef.from_json(data.get("image"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if image is not None:
            found[d.name] = image
    return found


def write_for(vm: VM) -> None:
    """Record what a later daemon needs to adopt ``vm`` (see :func:`write`)."""
    record = VMRecord(
        id=vm.id,
        pid=vm.pid,
        qmp=vm.rt.qmp,
        agent=vm.rt.agent,
        ram_file=vm.ram_file,
        origin_snapshot=vm.origin,
        origin_id=vm.origin_id,
        machine=vm.machine,
        image=vm.image,
        started_at_unix=vm.started_at,
        volumes=tuple(vm.volumes),
        network=vm.net,
        cgroup=vm.cgroup,
    )
    write(vm.rt, record)
