"""How the daemon starts a VM: the driver that makes it (QEMU's, or a unit test's
fake), the host network it joins and the cgroup it is placed in."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.settings import Settings
from forkd.guest.image import Image
from forkd.vmm.jail import cgroups
from forkd.vmm.jail.egress import Egress
from forkd.vmm.jail.network import HostNetwork
from forkd.vmm.volumes.disks import Attachment
from forkd.vmm.volumes.shares import Share

log = logging.getLogger(__name__)


class VMDriver(Protocol):
    """What the services need of :class:`forkd.vmm.vm.VM`'s constructors: the keywords
    they pass, and a :class:`SandboxVM` back."""

    async def boot(
        self,
        image: Image,
        *,
        run_root: Path,
        memory_mib: int = ...,
        vcpus: int = ...,
        accel_name: str | None = ...,
        vm_id: str | None = ...,
        boot_timeout: float = ...,
        attach: Sequence[Attachment] = ...,
        host_network: HostNetwork | None = ...,
        egress_policy: Egress | None = ...,
        cgroup: cgroups.Placement | None = ...,
    ) -> SandboxVM: ...
    async def restore(
        self,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = ...,
        detach: bool = ...,
        host_network: HostNetwork | None = ...,
        egress_policy: Egress | None = ...,
        cgroup: cgroups.Placement | None = ...,
        hostname: str | None = ...,
        seed: int | None = ...,
        shares: Sequence[Share] = ...,
    ) -> SandboxVM: ...
    async def spawn_incoming(
        self,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = ...,
        detach: bool = ...,
        host_network: HostNetwork | None = ...,
        cgroup: cgroups.Placement | None = ...,
    ) -> SandboxVM: ...
    async def adopt(self, run_dir: Path, paused: bool = False) -> SandboxVM: ...


def qemu_driver() -> VMDriver:
    """The driver of real VMs: :class:`forkd.vmm.vm.VM`'s constructors (imported only
    when no other driver is given)."""
    from forkd.vmm.vm import VM

    return VM  # its classmethods are the constructors: mypy checks they fit


def cgroup_hierarchy(settings: Settings) -> cgroups.Hierarchy:
    """Where VMs' groups go. The groups of VMs that died while no daemon watched are
    removed by :meth:`Lifecycle.remove_stray_cgroups`, once the strays are killed."""
    if settings.cgroup_parent is None:
        return cgroups.NoCgroups("turned off (--cgroup-parent none)")
    found = cgroups.detect(settings.cgroup_root, settings.cgroup_parent)
    (log.info if found.limits_memory else log.warning)("VM cgroups: %s", found.describe())
    return found


class Launcher:
    """``driver`` makes the VMs; each joins ``network`` and is placed under ``cgroups``."""

    def __init__(self, driver: VMDriver, network: HostNetwork, cgroups: cgroups.Hierarchy) -> None:
        self.driver = driver
        self.network = network
        self.cgroups = cgroups

    def placement(self, memory_limit_mib: int | None = None) -> cgroups.Placement | None:
        """Where a new VM's cgroup goes (None: the host has none for us)."""
        if not self.cgroups.limits_memory:
            return None
        return cgroups.Placement(self.cgroups, memory_limit_mib)
