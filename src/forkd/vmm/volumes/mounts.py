"""A VM's volumes while it runs: mounted in the guest at boot, layers frozen at a snapshot.

The volumes themselves (files, layers, chains) are :mod:`forkd.vmm.volumes.disks`'s;
this module is what a running VM does with them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from forkd import agent_wire as wire
from forkd.errors import SnapshotError, VMError
from forkd.vmm.volumes import disks as volumes
from forkd.vmm.volumes.disks import Attachment

if TYPE_CHECKING:  # a parameter's type: the volumes sit below QEMU, which mounts them
    from forkd.vmm.qemu.qmp import QMPChannel


class FdSets(Protocol):
    """QEMU's fd sets, as layers are handed to it (:class:`~forkd.vmm.qemu.qmp.QMPChannel`)."""

    async def add_fdset(self, path: Path, modes: Sequence[int]) -> int: ...
    async def remove_fdset(self, fdset: int) -> None: ...


MOUNT_TIMEOUT_SECS = 60
MOUNT_SCRIPT = (
    'for d in /sys/block/vd*; do if [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ]; then '
    'mkdir -p "$2" && exec mount -t ext4 -o "$3" "/dev/${d##*/}" "$2"; fi; done; '
    'echo "no disk with serial $1" >&2; exit 1'
)

Exec = Callable[..., Awaitable[wire.ExecAnswer]]  # VM.exec


async def mount_all(exec_in_guest: Exec, attached: Sequence[Attachment]) -> None:
    """Mount each volume at its path; the guest finds it by serial ``forkd-vol<i>``."""
    for i, att in enumerate(attached):
        opts = "ro,noload" if att.readonly else "rw"
        # Values travel as positional arguments: no string is pasted into the script.
        argv = ["/bin/sh", "-c", MOUNT_SCRIPT, "sh", f"forkd-vol{i}", att.path, opts]
        res = await exec_in_guest(argv, timeout=MOUNT_TIMEOUT_SECS)
        if res["exit_code"] != 0:
            raise VMError(
                f"mounting volume {att.name} at {att.path} failed: {res['stderr'].strip()}"
            )


@dataclass
class NextLayer:
    """A writable volume's next layer, made before a pause and handed to QEMU."""

    index: int  # the volume's drive: vol<index>
    chain: tuple[str, ...]  # the new layer first, then the chain it will freeze
    fdset: int  # QEMU opens it as /dev/fdset/<fdset>
    used: bool = False  # QEMU writes it now: it is the VM's, not the snapshot's leftover


async def prepare_layers(qmp: FdSets, attached: Sequence[Attachment]) -> list[NextLayer]:
    """While the VM runs: an empty layer over each writable volume, passed to QEMU.

    QEMU may not create files under forkd's directories (it runs as its own
    user), and ``qemu-img`` takes too long for the pause: the daemon makes
    the layers now and :func:`freeze_layers` puts them in place.
    """
    prepared: list[NextLayer] = []
    try:
        for i, att in enumerate(attached):
            if att.readonly:
                continue
            chain = await asyncio.to_thread(volumes.new_layer, att.chain)
            try:
                fdset = await qmp.add_fdset(Path(chain[0]), (os.O_RDONLY, os.O_RDWR))
            except BaseException:
                Path(chain[0]).unlink(missing_ok=True)
                raise
            prepared.append(NextLayer(i, chain, fdset))
    except BaseException:
        await discard_layers(qmp, prepared)
        raise
    return prepared


async def discard_layers(qmp: FdSets, prepared: Sequence[NextLayer]) -> None:
    """Delete the layers of :func:`prepare_layers` that QEMU did not take, and their fd sets.

    A layer QEMU took keeps its set's read-only descriptor, with which QEMU
    reopens it read-only when a later snapshot freezes it.
    """
    for nxt in prepared:
        if not nxt.used:
            await qmp.remove_fdset(nxt.fdset)
            Path(nxt.chain[0]).unlink(missing_ok=True)


async def freeze_layers(
    qmp: QMPChannel, attached: list[Attachment], prepared: Sequence[NextLayer]
) -> list[Attachment]:
    """At a pause: freeze each writable volume's layer for a snapshot; returns the frozen set.

    QEMU puts the prepared layer above the current one, which from now on no
    one writes; the snapshot keeps that frozen chain. ``attached`` is updated
    in place after each volume, so a failure half-way still leaves the VM's
    record naming every layer QEMU writes.
    """
    by_drive = {nxt.index: nxt for nxt in prepared}
    frozen: list[Attachment] = []
    for i, att in enumerate(attached):
        frozen.append(att)
        if att.readonly:
            continue
        nxt = by_drive.get(i)
        if nxt is None or nxt.chain[1:] != att.chain:
            raise SnapshotError(f"volume {att.name} changed while its snapshot was prepared")
        await qmp.execute(
            "blockdev-snapshot-sync",
            {
                "device": f"vol{i}",
                "snapshot-file": f"/dev/fdset/{nxt.fdset}",
                "format": "qcow2",
                "mode": "existing",
            },
        )
        nxt.used = True
        attached[i] = Attachment(att.name, att.path, False, nxt.chain)
    return frozen


def remove_own_layers(attached: Sequence[Attachment]) -> None:
    """Delete the layers only these attachments' VM writes (the VM is gone)."""
    for att in attached:
        layer: Path | None = volumes.own_layer(att)
        if layer is not None:
            layer.unlink(missing_ok=True)
