"""A VM's volumes while it runs: mounted in the guest at boot, layers frozen at a snapshot.

The volumes themselves (files, layers, chains) are :mod:`forkd.vmm.volumes`'s;
this module is what a running VM does with them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from forkd.errors import VMError
from forkd.vmm import volumes
from forkd.vmm.qmp_channel import QMPChannel
from forkd.vmm.volumes import Attachment

MOUNT_TIMEOUT_SECS = 60
MOUNT_SCRIPT = (
    'for d in /sys/block/vd*; do if [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ]; then '
    'mkdir -p "$2" && exec mount -t ext4 -o "$3" "/dev/${d##*/}" "$2"; fi; done; '
    'echo "no disk with serial $1" >&2; exit 1'
)

Exec = Callable[..., Awaitable[dict[str, Any]]]  # VM.exec


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


async def freeze_layers(qmp: QMPChannel, attached: list[Attachment]) -> list[Attachment]:
    """At a pause: freeze each writable volume's layer for a snapshot; returns the frozen set.

    QEMU gives the VM a new empty layer above the current one, which from now
    on no one writes; the snapshot keeps that frozen chain. ``attached`` is
    updated in place after each volume, so a failure half-way still leaves
    the VM's record naming every layer QEMU writes.
    """
    frozen: list[Attachment] = []
    for i, att in enumerate(attached):
        frozen.append(att)
        if att.readonly:
            continue
        new = volumes.layer_path(att.chain)
        await qmp.execute(
            "blockdev-snapshot-sync",
            {"device": f"vol{i}", "snapshot-file": str(new), "format": "qcow2"},
        )
        attached[i] = Attachment(att.name, att.path, False, (str(new), *att.chain))
    return frozen


def remove_own_layers(attached: Sequence[Attachment]) -> None:
    """Delete the layers only these attachments' VM writes (the VM is gone)."""
    for att in attached:
        layer: Path | None = volumes.own_layer(att)
        if layer is not None:
            layer.unlink(missing_ok=True)
