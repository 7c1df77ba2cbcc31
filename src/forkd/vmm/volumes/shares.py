"""Host directories a guest mounts over 9p: E2B's shared volumes.

Unlike forkd's volumes (:mod:`forkd.vmm.volumes.disks`), which fork
copy-on-write, a share is one directory that every sandbox mounting it reads
and writes at once, as E2B's volumes are.

Every machine made now has :data:`SHARE_SLOTS` virtio-9p devices, tagged
``forkd-share<i>``, so a fork of any snapshot can be given shares: a restore
must present the devices its snapshot was taken with, but not the host paths
behind them, which are not in the saved state. A slot with no share serves an
empty read-only directory.

A snapshot is taken with the shares mounted: the sandbox it is taken of
keeps them, untouched. A 9p server's state (the guest's open files on it)
is not in the snapshot, though, so in a fork (or a woken sandbox) the mount
it carries is dead, and a device serves one mount at a time: :func:`mount`
first detaches that dead mount, then mounts the share afresh. A process in
the fork that held a file open on it gets errors from that file.
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from forkd import agent_wire as wire
from forkd.errors import Invalid, VMError

# Two: each slot costs a VM's QEMU about 1 MiB of private memory whether it is used or
# not (four took 4.6 MiB more per fork than none, two 2.2 MiB, measured side by side).
SHARE_SLOTS = 2
MOUNT_TIMEOUT_SECS = 30
# cache=none: every sandbox sees another's writes at once. msize: 9p's message size,
# the most one read or write moves (the kernel's virtio transport caps it at 500 KiB).
MOUNT_OPTIONS = "trans=virtio,version=9p2000.L,cache=none,msize=262144,nosuid,nodev"
# The path must name itself: no symbolic link on the way (the mount would cover its
# target instead). A 9p mount there already, the dead one a snapshot carried (on which
# even stat fails, with EPROTO), is detached first; any other mount is left alone, and
# mount then fails. Values travel as positional arguments, never pasted in.
MOUNT_SCRIPT = (
    'if grep -qF " $2 9p " /proc/mounts; then umount -l "$2" || exit 1; fi; '
    'mkdir -p "$2" || exit 1; '
    'if [ "$(realpath "$2")" != "$2" ]; then echo "$2 goes through a symbolic link" >&2; '
    "exit 1; fi; "
    'exec mount -t 9p -o "$3" "$1" "$2"'
)
GUEST_PATH_MAX = 1024

Exec = Callable[..., Awaitable[wire.ExecAnswer]]  # VM.exec


def share_tag(slot: int) -> str:
    """The mount tag the guest names slot ``slot``'s device by."""
    return f"forkd-share{slot}"


@dataclass(frozen=True)
class Share:
    """A host directory served in slot ``slot``, mounted at ``guest_path``."""

    slot: int
    host_dir: Path
    guest_path: str
    readonly: bool = False
    name: str = ""  # what the user calls it (a volume's name), for messages


def check_guest_path(path: str) -> str:
    """``path`` if it can be a mount point: absolute, normalised, not ``/`` itself."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise Invalid(f"a volume's mount path must be absolute: {path!r}")
    if any(c.isspace() or c in "\\\0" for c in path):  # /proc/mounts escapes them
        raise Invalid(f"a volume's mount path has a space, backslash or NUL: {path!r}")
    if len(path) > GUEST_PATH_MAX:
        raise Invalid(f"a volume's mount path is longer than {GUEST_PATH_MAX} characters")
    clean = posixpath.normpath(path)
    if clean.startswith("//"):
        clean = "/" + clean.lstrip("/")
    if clean == "/" or clean.split("/")[1] in ("proc", "sys", "dev", "opt"):
        raise Invalid(f"a volume cannot be mounted at {path!r}")
    return clean


def check_shares(shares: Sequence[Share], slots: int) -> None:
    """Refuse more shares than slots, two in one slot, or two at one path."""
    if len(shares) > slots:
        raise Invalid(f"at most {slots} volumes can be mounted in one sandbox")
    if len({s.slot for s in shares}) != len(shares) or any(not 0 <= s.slot < slots for s in shares):
        raise Invalid("each volume needs a slot of its own")
    paths = [s.guest_path for s in shares]
    if len(set(paths)) != len(paths):
        raise Invalid("two volumes cannot be mounted at one path")


def fsdev_args(slots: int, shares: Sequence[Share], empty: Path) -> list[str]:
    """QEMU's devices for ``slots`` slots: each share's directory, else ``empty``.

    ``mapped-xattr``: the guest's owners, modes and special files are kept in
    extended attributes of plain files QEMU creates as its own user, so no
    guest can make a host device node, setuid file or symbolic link. Each
    sandbox's QEMU runs as a user of its own, so files are created readable
    and writable by every one of them (``fmode``/``dmode``; the directory's
    parent stays closed to everyone else on the host).
    """
    by_slot = {s.slot: s for s in shares}
    argv: list[str] = []
    for slot in range(slots):
        share = by_slot.get(slot)
        path = str(share.host_dir if share else empty).replace(",", ",,")
        readonly = ",readonly=on" if share is None or share.readonly else ""
        argv += [
            "-fsdev",
            f"local,id=share{slot},path={path},security_model=mapped-xattr,"
            f"fmode=0666,dmode=0777{readonly}",
            "-device",
            f"virtio-9p-device,fsdev=share{slot},mount_tag={share_tag(slot)}",
        ]
    return argv


async def mount(exec_in_guest: Exec, shares: Sequence[Share]) -> None:
    """Mount each share at its path in the guest."""
    for share in shares:
        opts = MOUNT_OPTIONS + (",ro" if share.readonly else "")
        argv = ["/bin/sh", "-c", MOUNT_SCRIPT, "sh", share_tag(share.slot), share.guest_path, opts]
        res = await exec_in_guest(argv, timeout=MOUNT_TIMEOUT_SECS)
        if res["exit_code"] != 0:
            what = share.name or share_tag(share.slot)
            raise VMError(
                f"mounting volume {what} at {share.guest_path} failed: {res['stderr'].strip()}"
            )
