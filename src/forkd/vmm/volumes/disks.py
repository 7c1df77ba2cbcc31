"""Persistent volumes that fork and branch copy-on-write, like guest memory.

A volume is an ext4 filesystem in a sparse raw file, ``<root>/<name>/base.img``.
A VM never writes it: a writable attachment gets its own qcow2 *layer* on
top (``<root>/<name>/layers/<id>.qcow2``). When a running VM is snapshotted,
QEMU's ``blockdev-snapshot-sync`` freezes its current layer (the snapshot
keeps it) and gives the VM a fresh layer above it; every child forked from
the snapshot then gets its own new layer over the frozen one. So children
see the volume as it was at the snapshot, write privately, and share every
block they have not written: the same semantics as memory.

Each attachment records its layer *chain* (top first, base last) so layers
no snapshot or VM needs any more can be deleted (:meth:`VolumeStore.collect`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd import hosttools
from forkd.archive import ArchiveError, ArchiveTooLarge, Limits
from forkd.disk_reserve import free_bytes
from forkd.errors import (
    Conflict,
    ForkdError,
    HostToolMissing,
    Invalid,
    NoRoom,
    NotFound,
    StorageFull,
)
from forkd.limits import (
    NAME_RE,
    VOLUME_BYTES_PER_ENTRY,
    VOLUME_MAX_ENTRIES,
    VOLUME_TAR_HEADER_LIMIT,
)
from forkd.vmm.jail import archive as archive_jail

MIN_SIZE = 16 << 20
MAX_SIZE = 1 << 40


class VolumeError(ForkdError):
    """Any volume failure; each kind below is also the general error of its kind.

    Callers catch the :mod:`forkd.errors` classes (``NotFound``, ``Conflict``,
    ``Invalid``); a failure to make a layer is a plain ``ForkdError`` (500).
    """


class VolumeNotFound(VolumeError, NotFound):
    """No volume of that name."""


class VolumeExists(VolumeError, Conflict):
    """A volume of that name exists already."""


class VolumeInvalid(VolumeError, Invalid):
    """A bad name, size, mount point or content archive."""


class LayerError(VolumeError):
    """``qemu-img`` could not create a copy-on-write layer (a host failure)."""


@dataclass(frozen=True)
class Attachment:
    """One volume as a VM sees it: mounted at ``path``, backed by ``chain``."""

    name: str
    path: str  # mount point in the guest
    readonly: bool
    chain: tuple[str, ...]  # layer files, top first; the last is base.img

    @property
    def top(self) -> Path:
        return Path(self.chain[0])

    @property
    def format(self) -> str:
        return "raw" if self.top.name == "base.img" else "qcow2"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "readonly": self.readonly,
            "chain": list(self.chain),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Attachment:
        return cls(
            str(data["name"]), str(data["path"]), bool(data.get("readonly")), tuple(data["chain"])
        )


EXT4_MAGIC_OFFSET = 1024 + 0x38  # the superblock's s_magic
EXT4_MAGIC = b"\x53\xef"


def is_ext4(image: Path) -> bool:
    """Whether ``image`` starts with an ext2/3/4 superblock (its magic number)."""
    with image.open("rb") as f:
        f.seek(EXT4_MAGIC_OFFSET)
        return f.read(2) == EXT4_MAGIC


def parse_size(text: str | int) -> int:
    """``1G``, ``512M``, ``300000000`` → bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise VolumeInvalid(f"cannot read size {text!r}: use e.g. 512M or 1G")
    unit = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(m.group(1)) * unit


def check_guest_mount(path: str) -> str:
    if not path.startswith("/") or path == "/" or "\0" in path or ".." in path.split("/"):
        raise VolumeInvalid(f"mount point {path!r} must be an absolute path below /")
    if not re.fullmatch(r"[A-Za-z0-9_./-]+", path):
        raise VolumeInvalid(f"mount point {path!r} may hold only letters, digits and _ . / -")
    return path.rstrip("/")


GZIP_MAGIC = b"\x1f\x8b"


def max_entries(size: int) -> int:
    """How many files, directories and links an archive for a ``size``-byte volume may hold."""
    return min(VOLUME_MAX_ENTRIES, size // VOLUME_BYTES_PER_ENTRY)


def content_limits(size: int) -> Limits:
    """What an archive may hold to fill a volume of ``size`` bytes."""
    return Limits(
        max_entries=max_entries(size), max_bytes=size, max_header_bytes=VOLUME_TAR_HEADER_LIMIT
    )


def _extract(content: Path | bytes, tree: Path, size: int) -> None:
    """Unpack ``content`` into ``tree`` within a volume of ``size`` bytes.

    A plain tar, or a gzip-compressed one, told apart by its first bytes (not
    by any header the client sent), unpacked by forkd's one extractor
    (:mod:`forkd.archive`, the ``data`` policy), as a uid of its own when the
    daemon is root (:mod:`forkd.vmm.jail.archive`): entries are counted as they
    stream in, so a small archive that expands to far more than ``size`` is
    refused after writing at most ``size`` bytes; nothing is written outside
    ``tree`` or through a link, and devices are refused.
    """
    try:
        archive_jail.unpack(content, tree, content_limits(size))
    except ArchiveTooLarge as exc:
        raise VolumeInvalid(f"too large for a volume of {size} bytes: {exc}") from exc
    except ArchiveError as exc:
        raise VolumeInvalid(f"the upload is not a usable tar archive: {exc}") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFull(
                "the host's disk filled up while unpacking the volume's content; nothing was kept"
            ) from exc
        raise


class VolumeStore:
    def __init__(self, root: Path, reserve_bytes: int = 0) -> None:
        self.root = root
        self.reserve_bytes = reserve_bytes  # free disk no volume may count on (--disk-reserve)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _dir(self, name: str) -> Path:
        if not NAME_RE.fullmatch(name):
            raise VolumeInvalid(f"invalid volume name {name!r}: 1-64 of A-Z a-z 0-9 _ -")
        return self.root / name

    def exists(self, name: str) -> bool:
        return (self._dir(name) / "volume.json").is_file()

    def get(self, name: str) -> dict[str, Any]:
        d = self._dir(name)
        try:
            info: dict[str, Any] = json.loads((d / "volume.json").read_text())
        except (OSError, ValueError) as exc:
            raise VolumeNotFound(f"volume {name!r} not found") from exc
        base = d / "base.img"
        layers = list((d / "layers").glob("*.qcow2"))
        info["allocated_bytes"] = base.stat().st_blocks * 512 + sum(
            p.stat().st_blocks * 512 for p in layers
        )
        info["layers"] = len(layers)
        return info

    def list(self) -> list[dict[str, Any]]:
        return [
            self.get(d.name)
            for d in sorted(self.root.iterdir())
            if not d.name.startswith(".") and (d / "volume.json").is_file()
        ]

    def check_size(self, size: int, beside: str = "") -> None:
        """``size`` is within bounds, and a volume that fills up to it fits on the host
        above the reserve (:class:`NoRoom` when it does not)."""
        if not MIN_SIZE <= size <= MAX_SIZE:
            raise VolumeInvalid(f"size must be between {MIN_SIZE >> 20} MiB and 1 TiB")
        free = free_bytes(self.root)
        if size + self.reserve_bytes > free:
            kept = self.reserve_bytes >> 20
            reserve = f", {kept} MiB of it kept free (--disk-reserve)" if kept else ""
            raise NoRoom(
                f"a volume of {size >> 20} MiB does not fit{beside}: the host's disk has "
                f"{free >> 20} MiB free where volumes are kept{reserve}"
            )

    def create(
        self, name: str, size: int, content_tar: Path | bytes | None = None
    ) -> dict[str, Any]:
        """A new ext4 volume; ``content_tar`` (a tar or tar.gz archive, as a file or
        its bytes) fills it, unpacked within ``size`` (:func:`_extract`)."""
        final = self._dir(name)
        if final.exists():
            raise VolumeExists(f"volume {name!r} already exists")
        self.check_size(size)
        hosttools.require("mkfs.ext4")
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{name}.partial-"))
        try:
            base = staging / "base.img"
            with base.open("wb") as f:
                f.truncate(size)
            # Inode tables and journal initialised now, not lazily by the guest
            # kernel later: that background zeroing would write into every
            # child's private layer.
            opts = "root_owner=0:0,lazy_itable_init=0,lazy_journal_init=0"
            argv = ["mkfs.ext4", "-q", "-F", "-L", name[:16], "-E", opts]
            if content_tar is not None:
                tree = staging / "content"
                tree.mkdir()
                _extract(content_tar, tree, size)
                self.check_size(size, beside=" next to its unpacked content")
                argv += ["-d", str(tree)]
            try:
                hosttools.run([*argv, str(base)], what=f"formatting volume {name}")
            except HostToolMissing:
                raise
            except ForkdError as exc:  # e.g. the content does not fit in the size asked for
                raise VolumeInvalid(str(exc)) from exc
            shutil.rmtree(staging / "content", ignore_errors=True)
            self._commit(staging, final, name, size)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.get(name)

    def create_filled(self, name: str, size: int, fill: Callable[[int], None]) -> str:
        """A new volume whose ``base.img`` ``fill(fd)`` writes (a disk pulled from a
        registry): named ``name``, or ``name-<hex>`` when that is taken. Staged and
        renamed into place; returns the name it got."""
        self.check_size(size)
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{name}.partial-"))
        try:
            fd = os.open(staging / "base.img", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            (staging / "layers").mkdir(mode=0o700)
            for _ in range(8):
                info = {"name": name, "size_bytes": size, "created_at_unix": int(time.time())}
                (staging / "volume.json").write_text(json.dumps(info) + "\n")
                try:
                    staging.rename(self._dir(name))
                    return name
                except OSError as exc:
                    if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                name = f"{name[:56]}-{secrets.token_hex(3)}"
            raise VolumeExists(f"no free name for volume {name!r}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def create_from_image(self, name: str, image: Path) -> dict[str, Any]:
        """A new volume whose base is the ext4 image file ``image`` (in this store's
        directory: it is renamed, never copied); staged and renamed into place. The host
        never mounts it: only a guest's kernel reads it, as a disk of its own."""
        final = self._dir(name)
        if final.exists():
            raise VolumeExists(f"volume {name!r} already exists")
        size = image.stat().st_size
        if not MIN_SIZE <= size <= MAX_SIZE or size % 512:
            raise VolumeInvalid(
                f"an ext4 image of {size} bytes: a volume is 16 MiB to 1 TiB, "
                "in whole 512-byte sectors"
            )
        if not is_ext4(image):
            raise VolumeInvalid("not an ext4 file system image (no ext4 superblock)")
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{name}.partial-"))
        try:
            os.rename(image, staging / "base.img")
            self._commit(staging, final, name, size)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.get(name)

    @staticmethod
    def _commit(staging: Path, final: Path, name: str, size: int) -> None:
        """A staged volume (its ``base.img`` written) given its record and renamed into
        place; :class:`VolumeExists` when another request made the name meanwhile."""
        (staging / "layers").mkdir(mode=0o700)
        info = {"name": name, "size_bytes": size, "created_at_unix": int(time.time())}
        (staging / "volume.json").write_text(json.dumps(info) + "\n")
        for made in (staging / "base.img", staging / "volume.json"):  # the dir is 0700
            made.chmod(0o600)
        try:
            staging.rename(final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise VolumeExists(f"volume {name!r} already exists") from exc
            raise

    def upload_file(self) -> tuple[int, Path]:
        """A new empty file in this store's directory for an image on its way in (marked
        with this process: a daemon that dies leaves nothing a later one keeps)."""
        from forkd import processes

        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.root / f".upload-{processes.mark()}{secrets.token_hex(8)}.img"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path

    def remove_dead_uploads(self) -> int:
        """At the daemon's start: remove the images on their way in whose daemon is gone,
        and staged volumes a crash left (the store is this daemon's: none is being made
        now); how many."""
        from forkd import processes

        removed = 0
        for path in self.root.glob(".upload-*.img") if self.root.is_dir() else ():
            holder = processes.marked_by(path.name)
            if holder is None or not holder.alive():
                path.unlink(missing_ok=True)
                removed += 1
        for staged in self.root.glob(".*.partial-*") if self.root.is_dir() else ():
            shutil.rmtree(staged, ignore_errors=True)
            removed += 1
        return removed

    def remove(self, name: str) -> None:
        d = self._dir(name)
        if not (d / "volume.json").is_file():
            raise VolumeNotFound(f"volume {name!r} not found")
        trash = self.root / f".{name}.removing-{secrets.token_hex(3)}"
        d.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)

    def base(self, name: str) -> Path:
        base = self._dir(name) / "base.img"
        if not base.is_file():
            raise VolumeNotFound(f"volume {name!r} not found")
        return base

    def collect(self, in_use: set[str]) -> int:
        """Delete layers that no chain in ``in_use`` names; returns how many."""
        removed = 0
        for vol in self.root.iterdir():
            if vol.name.startswith("."):
                continue
            for layer in (vol / "layers").glob("*.qcow2"):
                if str(layer) not in in_use:
                    layer.unlink(missing_ok=True)
                    removed += 1
        return removed


def layer_path(chain: tuple[str, ...]) -> Path:
    """A new layer's file for a chain: in its volume's ``layers`` directory."""
    return Path(chain[-1]).parent / "layers" / f"{secrets.token_hex(8)}.qcow2"


def new_layer(chain: tuple[str, ...]) -> tuple[str, ...]:
    """A fresh empty qcow2 layer over ``chain``; returns the longer chain."""
    below = Path(chain[0])
    fmt = "raw" if below.name == "base.img" else "qcow2"
    layer = layer_path(chain)
    try:
        hosttools.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(below), "-F", fmt, str(layer)],
            what=f"creating a volume layer over {below}",
        )
    except ForkdError as exc:  # a host failure (500), not bad input
        raise LayerError(f"cannot create a volume layer: {exc}") from exc
    layer.chmod(0o600)  # qemu-img follows the umask; under the daemon's it is 0600 already
    return (str(layer), *chain)


def attach_for_boot(store: VolumeStore, name: str, path: str, readonly: bool) -> Attachment:
    """A template's attachment: the base itself (read-only) or a new layer over it."""
    mount = check_guest_mount(path)  # before a layer exists: bad input leaves nothing
    chain: tuple[str, ...] = (str(store.base(name)),)
    if not readonly:
        chain = new_layer(chain)
    return Attachment(name, mount, readonly, chain)


def attach_for_fork(frozen: Attachment) -> Attachment:
    """A child's attachment: shares a read-only volume, gets a new layer over a writable one."""
    if frozen.readonly:
        return frozen
    return Attachment(frozen.name, frozen.path, False, new_layer(frozen.chain))


def own_layer(att: Attachment) -> Path | None:
    """The layer only this attachment's VM writes (deleted with the VM)."""
    return None if att.readonly or att.format == "raw" else att.top
