"""What a VM's start is made of, before there is a VM: its id, its run directory (the
first thing a start makes and the last it undoes), the machine it runs (a booted
image's, or its snapshot's for a fork) and a fork's volumes."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Required, TypedDict

from forkd import accel, limits
from forkd.errors import VMError
from forkd.vmm import runtime_meta
from forkd.vmm.jail import cgroups, egress, network
from forkd.vmm.qemu import launch
from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths, kernel_cmdline
from forkd.vmm.qemu.host_processes import qemu_pid_matches
from forkd.vmm.snapshot.files import SnapshotFiles
from forkd.vmm.volumes import disks as volumes
from forkd.vmm.volumes import mounts as volume_mounts
from forkd.vmm.volumes.disks import Attachment
from forkd.vmm.volumes.shares import SHARE_SLOTS, Share, check_shares

if TYPE_CHECKING:  # only its type: the guest images sit above the VM
    from forkd.guest.image import Image


class SpawnOptions(TypedDict, total=False):
    """The keywords of :meth:`VM.spawn_incoming <forkd.vmm.vm.VM.spawn_incoming>`, which
    :meth:`VM.restore <forkd.vmm.vm.VM.restore>` passes on."""

    run_root: Required[Path]
    vm_id: str | None
    detach: bool
    internet: bool | None
    host_network: network.HostNetwork | None
    egress_policy: egress.Egress | None
    cgroup: cgroups.Placement | None
    shares: Sequence[Share]


def new_vm_id() -> str:
    return f"vm-{secrets.token_hex(4)}"


def run_dir(run_root: Path, vm_id: str, undo: contextlib.AsyncExitStack) -> RuntimePaths:
    """The new VM's run directory, the first thing its start makes and the last it undoes."""
    rt = launch.prepare_runtime(run_root, vm_id)
    undo.callback(shutil.rmtree, rt.dir, ignore_errors=True)
    return rt


def left_running(run_dir: Path) -> tuple[RuntimePaths, runtime_meta.VMRecord]:
    """The run directory of a VM an earlier daemon started (detached) and its record;
    :class:`VMError` when its QEMU is gone or is not the one the record names."""
    rt = RuntimePaths(run_dir)
    rec = runtime_meta.read(rt)
    if not qemu_pid_matches(rec.pid, run_dir):
        cgroups.remove(rec.cgroup, 0)  # nothing is left in it (the kernel refuses otherwise)
        raise VMError(f"QEMU of {rec.id} (pid {rec.pid}) is no longer running")
    return rt, rec


def boot_machine(
    image: Image, memory_mib: int, vcpus: int, accel_name: str | None, policy: egress.Egress
) -> MachineConfig:
    """The machine that boots ``image``: :class:`forkd.errors.Invalid` for a size out of
    range, the accelerator chosen by evidence (``accel_name``: the one asked for)."""
    limits.check_memory_mib(memory_mib)
    limits.check_vcpus(vcpus)
    choice = accel.choose(accel_name)
    return MachineConfig(
        memory_mib=memory_mib,
        vcpus=vcpus,
        accel=choice.name,
        vmlinuz=image.vmlinuz,
        initrd=image.initrd,
        rootfs=image.rootfs,
        internet=policy.mode != "none",
        cmdline=kernel_cmdline(choice.name, runtime=image.runtime is not None),
        egress=policy.to_json(),
        runtime=image.runtime,
        shares=SHARE_SLOTS,
    )


def fork_machine(
    snap: SnapshotFiles,
    internet: bool | None,
    egress_policy: egress.Egress | None,
    shares: Sequence[Share] = (),
) -> tuple[egress.Egress, MachineConfig]:
    """A fork's egress policy (``egress_policy``, else ``internet``, else the snapshot's)
    and its machine: the snapshot's, with that policy. Refuses ``shares`` it has no
    slots for."""
    machine = snap.machine
    check_fork_shares(machine, shares)
    policy = egress_policy or (
        egress.Egress.from_internet(internet)
        if internet is not None
        else egress.of_machine(machine.egress, machine.internet)
    )
    # The network is a netdev option, not a device: the restored state still fits.
    return policy, dataclasses.replace(
        machine, internet=policy.mode != "none", egress=policy.to_json()
    )


def check_fork_shares(machine: MachineConfig, shares: Sequence[Share]) -> None:
    """Refuse shares a fork of ``machine`` has no slots for (a snapshot made before them)."""
    if shares and not machine.shares:
        raise VMError("this snapshot was made before forkd had shared volumes: rebuild it")
    check_shares(shares, machine.shares)


def fork_volumes(snap: SnapshotFiles, undo: contextlib.AsyncExitStack) -> list[Attachment]:
    """A fork's volumes: each writable one gets this child's layer over its own (removed
    again if the start fails)."""
    attach: list[Attachment] = []
    undo.callback(volume_mounts.remove_own_layers, attach)
    for f in snap.meta.volumes:
        attach.append(volumes.attach_for_fork(f))
    return attach
