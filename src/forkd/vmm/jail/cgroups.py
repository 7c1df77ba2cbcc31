"""A cgroup per VM: the memory, CPU and process caps its QEMU runs under.

One interface, :class:`Hierarchy`, with two backends: :class:`V2` where the
host has the unified hierarchy (``/sys/fs/cgroup/cgroup.controllers``
exists) and :class:`V1` where it mounts each controller apart
(``/sys/fs/cgroup/memory``, ``cpu``, ``pids``). :func:`detect` picks one, or
:class:`NoCgroups` when the host has no cgroup filesystem forkd may write
(not root): VMs then run without caps, and ``forkd doctor`` says so.

A VM's group is ``<parent>/<vm id>`` in each hierarchy (``forkd/sb-...``).
Its QEMU is moved into it (:func:`move`) while it waits at its start, before
it is QEMU (:func:`forkd.vmm.qemu.launch.spawn`), so every page and thread QEMU
ever has is charged to the group, and no guest code runs outside it. The
group is removed once QEMU has exited (:func:`remove`); a :class:`Group` is a
plain record, kept in ``vm.json``, so a daemon that adopts a VM can remove its
group without a :class:`Hierarchy`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.errors import Invalid, VMError

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PARENT = "forkd"
CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000

# What QEMU itself takes beside guest RAM (docs/RUNBOOK.md, "Limits"). Under
# TCG an idle fork of a 256 MiB Python template is charged 72 MiB (50 MiB
# anonymous: QEMU's heap and the guest pages it wrote; the rest page cache,
# which the kernel reclaims at the cap); its translation cache grows to 64 MiB
# as a busy guest runs new code. 128 MiB covers heap + cache + the agent
# channel's buffers with a margin, so a guest that fills its own RAM meets
# its own kernel's OOM killer, never the host's. KVM has no translation cache.
OVERHEAD_MIB = {"tcg": 128, "kvm": 64}
# QEMU's threads: main loop, RCU, one per vCPU, a few workers (measured 5-6:
# idle, booting, eight guest readers of its disk); its block thread pool may
# grow to 64 workers. pids.max = PIDS_BASE + vCPUs stops a runaway, never QEMU.
PIDS_BASE = 96

_PARENT_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


@dataclass(frozen=True)
class Limits:
    """The caps one VM's group is given."""

    memory_bytes: int  # RAM; swap is not allowed beyond it
    cpu_quota_us: int  # per CPU_PERIOD_US: one period per vCPU
    pids_max: int
    cpu_period_us: int = CPU_PERIOD_US

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes >> 20


def overhead_mib(accel: str) -> int:
    return OVERHEAD_MIB.get(accel, OVERHEAD_MIB["tcg"])


def min_memory_limit_mib(accel: str) -> int:
    """The smallest ``memory_limit_mib`` a VM under ``accel`` runs with.

    QEMU's own overhead: under TCG a fork limited to 80 MiB is killed at its
    first small allocation, one limited to 100 MiB runs Python.
    """
    return overhead_mib(accel)


def check_memory_limit(memory_limit_mib: int, guest_mib: int, accel: str) -> int:
    """``memory_limit_mib`` if a guest of ``guest_mib`` can run under it, else :class:`Invalid`."""
    least = min_memory_limit_mib(accel)
    if memory_limit_mib < least:
        raise Invalid(
            f"memory_limit_mib {memory_limit_mib} is below what this sandbox needs: its QEMU "
            f"({accel}) alone takes up to {least} MiB, so the least is {least}. The default, "
            f"{guest_mib + overhead_mib(accel)}, is the guest's {guest_mib} MiB plus that; "
            "a limit below the guest's RAM gets the sandbox killed when it uses more"
        )
    return memory_limit_mib


def limits_for(
    guest_mib: int, vcpus: int, accel: str, memory_limit_mib: int | None = None
) -> Limits:
    """A VM's caps: ``memory_limit_mib``, or guest RAM plus QEMU's overhead; a CPU per vCPU."""
    if memory_limit_mib is None:
        memory_limit_mib = guest_mib + overhead_mib(accel)
    check_memory_limit(memory_limit_mib, guest_mib, accel)
    return Limits(
        memory_bytes=memory_limit_mib << 20,
        cpu_quota_us=vcpus * CPU_PERIOD_US,
        pids_max=PIDS_BASE + vcpus,
    )


@dataclass(frozen=True)
class Placement:
    """Where a new VM's group goes, and its memory cap (None: guest RAM + overhead)."""

    hierarchy: Hierarchy
    memory_limit_mib: int | None = None


@dataclass(frozen=True)
class Group:
    """One VM's group: its directory in each hierarchy (one on v2, one per controller on v1)."""

    version: str  # "v2" | "v1"
    dirs: tuple[Path, ...]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "dirs": [str(d) for d in self.dirs]}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Group | None:
        if not data:
            return None
        return cls(str(data["version"]), tuple(Path(d) for d in data["dirs"]))


# The two calls that differ on a real cgroup filesystem, where the kernel fills
# a new directory with its files and removes them with it; unit tests replace
# them with a fake kernel over a temporary directory.
def make_dir(path: Path) -> None:
    os.mkdir(path)


def remove_dir(path: Path) -> None:
    os.rmdir(path)


def _write(path: Path, value: str) -> None:
    """Write one value to a kernel interface file (never creating it)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class Hierarchy:
    """Where VMs' groups are made; :meth:`create` one per VM."""

    version = "none"

    def __init__(self, root: Path, parent: str, controllers: tuple[str, ...] = ()) -> None:
        self.root = root
        self.parent = parent
        self.controllers = controllers

    @property
    def limits_memory(self) -> bool:
        return "memory" in self.controllers

    def describe(self) -> str:
        raise NotImplementedError

    def prepare(self) -> None:
        """Make the parent group and give it the controllers (idempotent)."""

    def create(self, name: str, limits: Limits) -> Group | None:
        """Make ``<parent>/<name>`` with ``limits``; :class:`VMError` if that fails."""
        raise NotImplementedError

    def parent_dirs(self) -> list[Path]:
        """The parent group's directory in each hierarchy."""
        return []

    def remove_unused(self, prefixes: tuple[str, ...]) -> list[str]:
        """Remove the empty groups whose names start with one of ``prefixes``.

        For a daemon starting up: groups named with its own id prefix that
        no process is in are what a crash, or VMs killed behind its back,
        left. A VM that still runs keeps its group: the kernel refuses to
        remove a group with a process in it.
        """
        return [
            n
            for n in self.names(prefixes)
            if remove(Group(self.version, self._dirs_of(n)), 0, quiet=True)
        ]

    def names(self, prefixes: tuple[str, ...]) -> list[str]:
        """The groups whose names start with one of ``prefixes``."""
        return sorted(
            {
                d.name
                for parent in self.parent_dirs()
                if parent.is_dir()
                for d in parent.iterdir()
                if d.is_dir() and d.name.startswith(prefixes)
            }
        )

    def _dirs_of(self, name: str) -> tuple[Path, ...]:
        return tuple(p / name for p in self.parent_dirs() if (p / name).is_dir())

    def _new_dir(self, d: Path) -> None:
        try:
            make_dir(d)
        except FileExistsError:
            # Left by a VM whose daemon died before removing it: reusable when empty.
            try:
                remove_dir(d)
                make_dir(d)
            except OSError as exc:
                raise VMError(f"cgroup {d} exists and is in use ({exc})") from exc


class NoCgroups(Hierarchy):
    """No writable cgroup filesystem: VMs run without caps."""

    def __init__(self, reason: str) -> None:
        super().__init__(CGROUP_ROOT, "")
        self.reason = reason

    def describe(self) -> str:
        return f"none: VMs run without memory, CPU or process caps ({self.reason})"

    def create(self, name: str, limits: Limits) -> Group | None:
        return None


class V2(Hierarchy):
    """The unified hierarchy: one directory per group, controllers enabled top-down."""

    version = "v2"

    @property
    def parent_dir(self) -> Path:
        return self.root / self.parent

    def parent_dirs(self) -> list[Path]:
        return [self.parent_dir]

    def describe(self) -> str:
        used = ", ".join(self.controllers) or "no controllers"
        return f"cgroup v2: {used} under {self.parent_dir}"

    def prepare(self) -> None:
        # Each level must hand the controllers down to the next; the leaves
        # (VM groups) hold the processes, so no level above may hold any.
        level = self.root
        for part in [*Path(self.parent).parts, None]:
            self._enable(level)
            if part is None:
                break
            level = level / part
            if not level.is_dir():
                make_dir(level)
        enabled = (self.parent_dir / "cgroup.subtree_control").read_text().split()
        self.controllers = tuple(c for c in CONTROLLERS if c in {e.lstrip("+") for e in enabled})

    def _enable(self, level: Path) -> None:
        control = level / "cgroup.subtree_control"
        try:
            _write(control, " ".join(f"+{c}" for c in self.controllers))
        except OSError:  # one refused (cpu with realtime tasks, say): enable the others
            for c in self.controllers:
                with contextlib.suppress(OSError):
                    _write(control, f"+{c}")

    def create(self, name: str, limits: Limits) -> Group:
        d = self.parent_dir / name
        self._new_dir(d)
        group = Group("v2", (d,))
        try:
            if "memory" in self.controllers:
                _write(d / "memory.max", str(limits.memory_bytes))
                if (d / "memory.swap.max").exists():  # only with swap accounting
                    _write(d / "memory.swap.max", "0")
            if "cpu" in self.controllers:
                _write(d / "cpu.max", f"{limits.cpu_quota_us} {limits.cpu_period_us}")
            if "pids" in self.controllers:
                _write(d / "pids.max", str(limits.pids_max))
        except OSError as exc:
            remove(group, 0)
            raise VMError(f"cannot set the limits of cgroup {d}: {exc}") from exc
        return group


class V1(Hierarchy):
    """One hierarchy per controller: a group is a directory in each."""

    version = "v1"

    def parent_dir(self, controller: str) -> Path:
        return self.root / controller / self.parent

    def parent_dirs(self) -> list[Path]:
        return [self.parent_dir(c) for c in self.controllers]

    def describe(self) -> str:
        where = self.root / "<controller>" / self.parent
        return f"cgroup v1: {', '.join(self.controllers) or 'no controllers'} under {where}"

    def prepare(self) -> None:
        for c in self.controllers:
            d = self.root / c
            for part in Path(self.parent).parts:
                d = d / part
                if not d.is_dir():
                    make_dir(d)

    def create(self, name: str, limits: Limits) -> Group:
        made: list[Path] = []
        try:
            for c in self.controllers:
                d = self.parent_dir(c) / name
                self._new_dir(d)
                made.append(d)
                self._set(c, d, limits)
        except (OSError, VMError) as exc:
            remove(Group("v1", tuple(made)), 0)
            if isinstance(exc, VMError):
                raise
            raise VMError(f"cannot set the limits of cgroup {made[-1]}: {exc}") from exc
        return Group("v1", tuple(made))

    @staticmethod
    def _set(controller: str, d: Path, limits: Limits) -> None:
        if controller == "memory":
            _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            # memsw (RAM + swap) exists only with swap accounting; equal to the
            # RAM limit, it allows no swap: a VM over its cap is stopped, not
            # left to crawl while it pushes the host into swapping.
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        elif controller == "cpu":
            _write(d / "cpu.cfs_period_us", str(limits.cpu_period_us))
            _write(d / "cpu.cfs_quota_us", str(limits.cpu_quota_us))
        elif controller == "pids":
            _write(d / "pids.max", str(limits.pids_max))


def check_parent(parent: str) -> str:
    if not _PARENT_RE.fullmatch(parent) or any(p in (".", "..") for p in parent.split("/")):
        raise Invalid(
            f"invalid cgroup parent {parent!r}: a relative path of names of "
            "A-Z, a-z, 0-9, '_', '.' and '-'"
        )
    return parent


def probe(root: Path = CGROUP_ROOT, parent: str = DEFAULT_PARENT) -> Hierarchy:
    """The hierarchy this host offers, without touching it (``forkd doctor``)."""
    check_parent(parent)
    if (root / "cgroup.controllers").is_file():
        available = set((root / "cgroup.controllers").read_text().split())
        h: Hierarchy = V2(root, parent, tuple(c for c in CONTROLLERS if c in available))
        writable = root / "cgroup.subtree_control"
    else:
        found = tuple(c for c in CONTROLLERS if (root / c / "cgroup.procs").is_file())
        if not found:
            return NoCgroups(f"no cgroup filesystem at {root}")
        h = V1(root, parent, found)
        writable = root / found[0] / "cgroup.procs"
    if not h.limits_memory:
        return NoCgroups(f"the memory controller is not available at {root}")
    if not os.access(writable, os.W_OK):
        return NoCgroups(f"{writable} is not writable: run the daemon as root")
    return h


def detect(root: Path = CGROUP_ROOT, parent: str = DEFAULT_PARENT) -> Hierarchy:
    """The hierarchy VMs' groups go in, its parent group made; :class:`NoCgroups` if none."""
    h = probe(root, parent)
    if isinstance(h, NoCgroups):
        return h
    try:
        h.prepare()
    except OSError as exc:
        return NoCgroups(f"cannot create the parent group {parent!r} under {root}: {exc}")
    if not h.limits_memory:
        return NoCgroups(f"the memory controller cannot be enabled under {root}/{parent}")
    return h


def move(group: Group, pid: int) -> None:
    """Put process ``pid`` (all its threads) into ``group``, in each hierarchy.

    QEMU is moved while it waits at its start (:func:`forkd.vmm.qemu.launch.spawn`),
    before it has allocated anything or run any guest code.
    """
    data = str(pid).encode()
    for d in group.dirs:
        fd = os.open(d / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def remove(group: Group | None, wait: float = 5.0, quiet: bool = False) -> bool:
    """Remove ``group``'s directories; True once all are gone.

    The kernel refuses (``EBUSY``) while a process is still in the group: a
    killed QEMU that is still exiting, or one nobody waits for. Retried for
    ``wait`` seconds. Any other failure is logged, not raised: it must not
    stop the rest of a VM's cleanup.
    """
    if group is None:
        return True
    deadline = time.monotonic() + wait
    left = list(group.dirs)
    while left:
        for d in list(left):
            try:
                remove_dir(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    if not quiet:
                        log.warning("cannot remove cgroup %s: %s", d, exc)
                    return False
                continue
            left.remove(d)
        if left:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    return True


def oom_killed(group: Group | None) -> bool:
    """Whether the kernel's OOM killer killed a process of the group at its memory cap:
    ``oom_kill`` in ``memory.events`` (v2) or in ``memory.oom_control`` (v1, Linux 4.13
    and later). False when the group or the count cannot be read."""
    if group is None:
        return False
    name = "memory.events" if group.version == "v2" else "memory.oom_control"
    for d in group.dirs:
        try:
            text = (d / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
    return False


def members(group: Group) -> set[int]:
    """The pids in ``group`` (its first directory)."""
    text = (group.dirs[0] / "cgroup.procs").read_text()
    return {int(p) for p in text.split()}
