"""The uid and gid each QEMU drops to: a pair of its own for every running VM.

A daemon running as root starts each QEMU as root, so that it can open what
the VM needs (the snapshot's RAM file, the volume layers, the tap device in
the VM's namespace); QEMU then drops to its uid (``-runas UID:GID``) before
the guest runs. No two running VMs share a uid, so a guest that escapes into
its QEMU cannot signal another tenant's QEMU. The uids come from a range
(``--vm-uid-range``, :data:`DEFAULT_RANGE`), as Firecracker's jailer takes
bare numbers: no passwd entries. The gid is the same number, and QEMU's only
group. Files QEMU must open later (a snapshot's device state, a new volume
layer) are opened by the daemon and handed over as descriptors
(:mod:`forkd.vmm.qemu.qmp`), so no uid needs access to any forkd directory.

Which uids are taken is host-wide state, kept by :class:`Registry` under
:data:`REGISTRY_DIR`: every forkd process on the host (a daemon, a template
build, a second daemon) takes its uids there, and it outlives a daemon
restart. An entry names the process that holds its uid, first the one
starting QEMU and then QEMU itself; once that process is gone the uid is free.
Only root writes there, so a QEMU cannot give its uid away while it runs.

The range is a host property, like the seccomp probe in :mod:`forkd.vmm.qemu.launch`:
one choice per process, set by the daemon's options (:func:`configure`). A
daemon that is not root starts QEMU as its own user and there is nothing to drop.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import pwd
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from forkd.errors import ForkdError, Invalid, OverCapacity
from forkd.processes import Holder

log = logging.getLogger(__name__)

# Beside /run/forkd, not in it: a unit's RuntimeDirectory=forkd (for a unix
# socket) is removed when the daemon stops, while its sandboxes run on.
REGISTRY_DIR = Path("/run/forkd-vm-uids")
ENTRY_VERSION = 1
LEGACY_USER = "forkd-qemu"  # the one user every QEMU shared before per-VM uids
_RANGE_PATTERN = re.compile(r"(\d+)-(\d+)")
_NO_ID = 2**32 - 1  # (uid_t) -1: "no change" to setresuid, never a real id


@dataclass(frozen=True)
class UidRange:
    """The uids (and, the same numbers, gids) QEMUs may be given: ``first`` to ``last``."""

    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> UidRange:
        """``START-END``, as ``--vm-uid-range`` takes it; :class:`Invalid` otherwise."""
        found = _RANGE_PATTERN.fullmatch(text.strip())
        if found is None:
            raise Invalid(f"--vm-uid-range must be START-END (two numbers), not {text!r}")
        uids = cls(int(found[1]), int(found[2]))
        if not 0 < uids.first <= uids.last < _NO_ID:
            raise Invalid(
                f"--vm-uid-range {text!r}: START must be at least 1, at most END, "
                f"and END below {_NO_ID}"
            )
        return uids

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


# The gap no other allocator hands out: systemd leaves 65536-524287 unused
# (docs UIDS-GIDS.md), and shadow's subordinate ids (/etc/subuid, for rootless
# containers and userns-remap) start at SUB_UID_MIN, 100000.
DEFAULT_RANGE = UidRange(65536, 99999)


@dataclass
class Lease:
    """A uid this process took for one VM, until the process holding it is gone."""

    registry: Registry
    uid: int
    holder: Holder  # who the entry names: this process until bound, then QEMU

    @property
    def gid(self) -> int:
        return self.uid

    @property
    def runas(self) -> str:
        """QEMU's ``-runas`` value: numbers, so no passwd entry is needed."""
        return f"{self.uid}:{self.gid}"

    def bind(self, pid: int) -> None:
        """Hand the uid to QEMU (process ``pid``): held for as long as it runs."""
        holder = Holder.of(pid)
        if holder is not None:  # else gone already: the start fails, release() frees it
            self.registry.hand_over(self.uid, holder)
            self.holder = holder

    def release(self) -> None:
        """Free the uid, unless the QEMU holding it still runs (it then frees itself)."""
        self.registry.release(self)


class Registry:
    """The host's taken uids of ``uids``: one file per uid in ``directory``.

    A file (``<uid>``) holds ``<version> <pid> <start ticks>``: the process
    holding the uid. A uid is free when it has no file, or when the process
    it names is gone. ``.next.<range>`` holds the uid of the range to try
    first: uids are handed out in turn through the range, so a uid just freed
    is the last to be reused. Every change is made under an exclusive ``flock``
    of ``.lock``.
    """

    def __init__(self, uids: UidRange, directory: Path = REGISTRY_DIR) -> None:
        self.uids = uids
        self.directory = directory

    def reserve(self) -> Lease:
        """A uid no running process holds, held by this process until :meth:`Lease.bind`."""
        me = Holder.of(os.getpid())
        assert me is not None
        with self._locked():
            start = self._next()
            for i in range(len(self.uids)):
                uid = self.uids.first + (start - self.uids.first + i) % len(self.uids)
                if self._live_holder(uid) is None:
                    self._write(uid, me)
                    self._set_next(uid + 1 if uid < self.uids.last else self.uids.first)
                    return Lease(self, uid, me)
        raise OverCapacity(
            f"every uid of --vm-uid-range {self.uids} ({len(self.uids)}) is held by a "
            f"running QEMU: widen the range, or stop VMs"
        )

    def claim(self, uid: int, pid: int) -> Lease | None:
        """The lease of a running QEMU (``pid``, dropped to ``uid``) this process did not
        start: a restarted daemon's re-adopted sandboxes. None when ``pid`` is gone."""
        holder = Holder.of(pid)
        if holder is None:
            return None
        with self._locked():
            other = self._live_holder(uid)
            if other is not None and other != holder:
                log.error("uid %d of QEMU %d is also held by process %d", uid, pid, other.pid)
            else:
                self._write(uid, holder)
        return Lease(self, uid, holder)

    def hand_over(self, uid: int, holder: Holder) -> None:
        """Name ``holder`` as the process holding ``uid`` (a reserved uid's QEMU)."""
        with self._locked():
            self._write(uid, holder)

    def release(self, lease: Lease) -> None:
        with self._locked():
            if self._read(lease.uid) != lease.holder:
                return  # another's by now
            if lease.holder.pid != os.getpid() and lease.holder.alive():
                return  # its QEMU still runs
            with contextlib.suppress(FileNotFoundError):
                (self.directory / str(lease.uid)).unlink()

    def holder(self, uid: int) -> Holder | None:
        """The running process holding ``uid``, or None when it is free."""
        with self._locked():
            return self._live_holder(uid)

    # ------------------------------------------------------------ the files

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._prepare()
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it

    def _prepare(self) -> None:
        """The directory, made 0700 when missing; refused when anyone else may write it."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ForkdError(
                f"{self.directory} must be a directory of uid {os.geteuid()} that no one "
                f"else may write: it says which QEMU uids are taken"
            )

    def _live_holder(self, uid: int) -> Holder | None:
        holder = self._read(uid)
        return holder if holder is not None and holder.alive() else None

    def _read(self, uid: int) -> Holder | None:
        try:
            version, pid, start = (self.directory / str(uid)).read_text().split()
            if int(version) != ENTRY_VERSION:
                return None
            return Holder(int(pid), int(start))
        except (OSError, ValueError):  # missing, or not an entry
            return None

    def _write(self, uid: int, holder: Holder) -> None:
        # Whole or not at all: a torn entry would read as free while its QEMU runs.
        tmp = self.directory / f".{uid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "w") as f:
            f.write(f"{ENTRY_VERSION} {holder.pid} {holder.start_ticks}\n")
        os.replace(tmp, self.directory / str(uid))

    def _next(self) -> int:
        try:
            uid = int(self._next_file.read_text())
        except (OSError, ValueError):
            return self.uids.first
        return uid if uid in self.uids else self.uids.first

    def _set_next(self, uid: int) -> None:
        self._next_file.write_text(f"{uid}\n")

    @property
    def _next_file(self) -> Path:
        return self.directory / f".next.{self.uids}"


_registry: Registry | None = Registry(DEFAULT_RANGE)


def configure(uids: UidRange | None, directory: Path = REGISTRY_DIR) -> None:
    """This process's choice: each QEMU drops to a uid of ``uids``; None: QEMU keeps
    the daemon's user (``--qemu-user none``)."""
    global _registry
    _registry = None if uids is None else Registry(uids, directory)


def reserve() -> Lease | None:
    """A uid for a QEMU started now, or None when QEMU keeps the daemon's user."""
    if _registry is None or os.geteuid() != 0:
        return None
    return _registry.reserve()


def adopt(pid: int, uid: int | None) -> Lease | None:
    """The lease of a running QEMU an earlier process started, as a restarted daemon
    finds it (``uid``: its real uid now); None when it runs as no uid of the range."""
    if _registry is None or os.geteuid() != 0 or uid not in _registry.uids:
        return None
    assert uid is not None
    return _registry.claim(uid, pid)


def current() -> tuple[UidRange | None, str]:
    """The range QEMUs drop into in this process (None: no drop), and why, for ``doctor``."""
    if _registry is None:
        return None, "turned off (--qemu-user none): QEMU keeps the daemon's user"
    if os.geteuid() != 0:
        return None, f"the daemon is not root: QEMU runs as its user (uid {os.geteuid()})"
    uids = _registry.uids
    return uids, (
        f"each QEMU drops to a uid and gid of its own from {uids} ({len(uids)} VMs at "
        "most), with no capability left, before the guest runs"
    )


def users_in(uids: UidRange) -> list[str]:
    """Users and groups this host names (passwd, group) whose ids fall in ``uids``."""
    found = [f"user {u.pw_name} ({u.pw_uid})" for u in pwd.getpwall() if u.pw_uid in uids]
    return found + [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if g.gr_gid in uids]


@dataclass(frozen=True)
class QemuUids:
    """The uids a QEMU a forkd started may run as (``uid in qemu_uids()``)."""

    daemon: int
    drop: UidRange | None
    legacy: int | None

    def __contains__(self, uid: object) -> bool:
        if not isinstance(uid, int):  # a process whose owner could not be read: not ours
            return False
        return uid in (self.daemon, self.legacy) or (self.drop is not None and uid in self.drop)


def qemu_uids() -> QemuUids:
    """This daemon's uid, the whole range (whichever uid a QEMU got, before a restart
    too), and :data:`LEGACY_USER`'s uid when that user exists (QEMUs an older forkd
    started)."""
    try:
        legacy: int | None = pwd.getpwnam(LEGACY_USER).pw_uid
    except KeyError:
        legacy = None
    return QemuUids(os.geteuid(), _registry.uids if _registry else None, legacy)
