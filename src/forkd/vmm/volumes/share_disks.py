"""Where a shared volume's files live on the host: an ext4 filesystem of its own.

Each volume is a sparse file, ``<root>/<id>/disk.img``, formatted ext4 and
loop-mounted at ``<root>/<id>/data`` (``nosuid,nodev,noexec``), which QEMU
serves over 9p. Its own filesystem bounds what sandboxes can write to the
volume's size: a guest filling its volume fills that file, never the host's
disk. Only QEMU's 9p server writes it, file by file: no guest ever sees the
block device, so none can hand the host's kernel a crafted filesystem.

``<root>`` is closed to everyone but root (0700); ``data`` is open to all
(0777), because each sandbox's QEMU runs as a user of its own and reaches it
through a descriptor opened before it dropped to that user, never by name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from forkd import hosttools
from forkd.errors import ForkdError, Unavailable

DISK = "disk.img"
DATA = "data"
# errors=remount-ro: should the host's disk fail under the image, the volume stops
# taking writes rather than going on with a damaged filesystem.
MOUNT_OPTIONS = "loop,nosuid,nodev,noexec,errors=remount-ro"


class ShareDisks:
    def __init__(self, root: Path) -> None:
        self.root = root

    def data_dir(self, volume_id: str) -> Path:
        return self.root / volume_id / DATA

    @staticmethod
    def volume_of(data_dir: Path) -> str:
        """The id of the volume whose ``data`` directory this is (:meth:`data_dir`)."""
        return data_dir.parent.name

    def create(self, volume_id: str, size_bytes: int) -> Path:
        """Format and mount a new volume's filesystem; returns its ``data`` directory.

        Made in a staging directory and renamed into place once formatted, so a
        volume is whole or absent; a failed mount removes it again.
        """
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        hosttools.require("mkfs.ext4")
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{volume_id}.partial-"))
        try:
            disk = staging / DISK
            with disk.open("wb") as f:
                f.truncate(size_bytes)
            opts = "root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0"
            hosttools.run(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", opts, str(disk)],
                what=f"formatting volume {volume_id}",
            )
            # Closed to all while nothing is mounted on it: nothing lands on the host's disk.
            (staging / DATA).mkdir(mode=0)
            staging.chmod(0o700)
            staging.rename(self.root / volume_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            data = self.mount(volume_id)
            # An empty volume is empty: lost+found comes back with e2fsck when needed.
            (data / "lost+found").rmdir()
        except BaseException:
            self.remove(volume_id)
            raise
        return data

    def mount(self, volume_id: str) -> Path:
        """Mount the volume's filesystem unless it is (a daemon's start mounts them all)."""
        data = self.data_dir(volume_id)
        if not os.path.ismount(data):
            disk = self.root / volume_id / DISK
            hosttools.run(
                ["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(disk), str(data)],
                what=f"mounting volume {volume_id}",
            )
        data.chmod(0o777)
        return data

    def mounted_data(self, volume_id: str) -> Path:
        """The volume's ``data``, if its filesystem is mounted there: :class:`Unavailable`
        otherwise (the directory beneath is the host's disk, unbounded)."""
        data = self.data_dir(volume_id)
        if not os.path.ismount(data):
            raise Unavailable(f"volume {volume_id} is not mounted (see the daemon's log)")
        return data

    def unmount(self, volume_id: str, lazily: bool = False) -> None:
        """Unmount the volume's filesystem; refused while in use unless ``lazily`` (then
        it goes once the last file open on it is closed)."""
        data = self.data_dir(volume_id)
        if os.path.ismount(data):
            flags = ["-l"] if lazily else []
            hosttools.run(["umount", *flags, str(data)], what=f"unmounting volume {volume_id}")

    def remove(self, volume_id: str) -> None:
        """Unmount (lazily: no one may mount it any more) and delete the volume's files,
        renamed aside first so a crash leaves it whole or marked for :meth:`sweep`."""
        home = self.root / volume_id
        if not home.exists():
            return
        doomed = self.root / f".{volume_id}.removed-{os.getpid()}"
        home.rename(doomed)
        if os.path.ismount(doomed / DATA):
            hosttools.run(["umount", "-l", str(doomed / DATA)], what=f"unmounting {volume_id}")
        shutil.rmtree(doomed, ignore_errors=True)

    def known(self) -> list[str]:
        """The volumes on disk (not the staging or removed ones)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))

    def used_bytes(self, volume_id: str) -> int:
        try:
            st = os.statvfs(self.data_dir(volume_id))
        except OSError as exc:
            raise ForkdError(f"volume {volume_id} cannot be read: {exc}") from exc
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def sweep(self) -> None:
        """Remove what a crash left half-made or half-removed."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.name.startswith(".") and (".partial-" in p.name or ".removed-" in p.name):
                if os.path.ismount(p / DATA):
                    hosttools.run(["umount", "-l", str(p / DATA)], what=f"unmounting {p.name}")
                shutil.rmtree(p, ignore_errors=True)
