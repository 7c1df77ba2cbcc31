"""``forkd doctor``: can this host run forkd VMs, and what to fix if not."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from forkd import accel, hosttools, paths
from forkd.errors import ForkdError
from forkd.guest import image

MIN_FREE_BYTES = 2 << 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True  # a failing fatal check means no VM can run


def _qemu_version() -> Check:
    try:
        path = hosttools.require("qemu-system-x86_64")
    except ForkdError as exc:
        return Check("qemu", False, "qemu-system-x86_64 is not installed", str(exc))
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    first = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "?"
    return Check("qemu", out.returncode == 0, f"{first} ({path})", "reinstall qemu-system-x86")


def _accel() -> Check:
    try:
        choice = accel.choose()
    except ValueError as exc:
        return Check("accelerator", False, str(exc), "set FORKD_ACCEL to auto, kvm or tcg")
    return Check("accelerator", True, f"{choice.name}: {choice.reason}")


def _network() -> Check:
    from forkd.vmm.jail import network

    problems = network.netns_problems()
    if not problems:
        return Check("network", True, "a network namespace per VM, egress by policy")
    return Check(
        "network",
        False,
        "user-mode NAT without egress (restrict=on): " + "; ".join(problems),
        "run the daemon as root with nftables and pyroute2 installed (./dev.sh installs both)",
        fatal=False,
    )


CONNTRACK_MAX = Path("/proc/sys/net/netfilter/nf_conntrack_max")


def _conntrack(conntrack_max: Path = CONNTRACK_MAX) -> Check:
    """Whether the host's connection-tracking table holds every sandbox's share.

    Each sandbox may keep :data:`forkd.vmm.jail.rulesets.MAX_GUEST_CONNS` connections
    tracked; the table is the host's, so when it fills the host itself drops
    new connections.
    """
    from forkd import limits
    from forkd.vmm.jail import rulesets

    sandboxes = limits.default_max_sandboxes()
    need = sandboxes * rulesets.MAX_GUEST_CONNS
    try:
        have = int(conntrack_max.read_text())
    except (OSError, ValueError):
        return Check("conntrack", True, "no connection tracking loaded yet (nf_conntrack)")
    ok = have >= need
    return Check(
        "conntrack",
        ok,
        f"nf_conntrack_max {have}: room for {have // rulesets.MAX_GUEST_CONNS} sandboxes at "
        f"{rulesets.MAX_GUEST_CONNS} connections each ({sandboxes} by default here)",
        f"sysctl -w net.netfilter.nf_conntrack_max={need}, or a lower --max-sandboxes",
        fatal=False,
    )


def _seccomp() -> Check:
    from forkd.vmm.qemu import launch

    problem = launch.seccomp_problem()
    if problem is None:
        return Check("qemu sandbox", True, "QEMU runs under -sandbox (seccomp filter)")
    return Check(
        "qemu sandbox",
        False,
        f"QEMU runs without -sandbox: {problem}",
        "install a QEMU built with seccomp (Debian's qemu-system-x86 is) on a kernel with "
        "CONFIG_SECCOMP_FILTER",
        fatal=False,
    )


def _qemu_user() -> Check:
    """What the daemon's --qemu-user and --vm-uid-range (as their variables say) give here."""
    from forkd.vmm.jail import qemu_user

    try:
        uids = qemu_user.UidRange.parse(
            os.environ.get("FORKD_VM_UID_RANGE", str(qemu_user.DEFAULT_RANGE))
        )
    except ForkdError as exc:
        return Check("qemu user", False, str(exc), "FORKD_VM_UID_RANGE=START-END", fatal=False)
    qemu_user.configure(None if os.environ.get("FORKD_QEMU_USER") == "none" else uids)
    found, why = qemu_user.current()
    if found is None:
        return Check(
            "qemu user",
            os.geteuid() != 0,
            why,
            "run the daemon without --qemu-user none",
            fatal=False,
        )
    named = qemu_user.users_in(found)
    if named:
        return Check(
            "qemu user",
            False,
            f"{why}; but this host has {', '.join(named[:3])} in that range",
            "give --vm-uid-range a range no user or group has",
            fatal=False,
        )
    return Check("qemu user", True, why)


def _cgroups() -> Check:
    from forkd.vmm.jail import cgroups

    found = cgroups.probe()
    if found.limits_memory:
        return Check("cgroups", True, f"a cgroup per VM: {found.describe()}")
    return Check(
        "cgroups",
        False,
        found.describe(),
        "run the daemon as root on a host with a cgroup filesystem (v2, or v1 with the "
        "memory, cpu and pids controllers)",
        fatal=False,
    )


def _build_tools() -> Check:
    missing = []
    for tool in (
        "mmdebstrap",
        "mksquashfs",
        "cpio",
        "depmod",
        "dpkg-deb",
        "apt-get",
        "qemu-img",
        "mkfs.ext4",
    ):
        try:
            hosttools.require(tool)
        except ForkdError:
            missing.append(f"{tool} ({hosttools.PACKAGES[tool]})")
    try:
        hosttools.require_static_busybox()
    except ForkdError:
        missing.append("static busybox (busybox-static)")
    if missing:
        return Check(
            "image tools",
            False,
            "missing: " + ", ".join(missing),
            "apt-get install --no-install-recommends the packages named",
            fatal=False,
        )
    return Check(
        "image tools",
        True,
        "mmdebstrap, mksquashfs, cpio, kmod, busybox-static; qemu-img, mkfs.ext4 for volumes",
    )


def _images() -> Check:
    built = image.list_images()
    try:
        current = image.find_image(image.DEFAULT_IMAGE)
    except ForkdError:
        current = None
    if current is None:
        return Check(
            "images",
            False,
            f"{len(built)} built; the default image is not built",
            f"forkd image build {image.DEFAULT_IMAGE}",
            fatal=False,
        )
    size = current.size_bytes() / (1 << 20)
    return Check(
        "images",
        True,
        f"{len(built)} built in {paths.images_dir()}; default "
        f"{current.name}-{current.key} ({size:.0f} MiB)",
    )


def _free(label: str, where: Path) -> Check:
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    ok = usage.free >= MIN_FREE_BYTES
    return Check(
        f"disk ({label})",
        ok,
        f"{usage.free / (1 << 30):.1f} GiB free at {where}",
        f"free space under {probe}: snapshots need up to their memory size each",
        fatal=False,
    )


def run_checks() -> list[Check]:
    return [
        _qemu_version(),
        _accel(),
        _network(),
        _conntrack(),
        _seccomp(),
        _qemu_user(),
        _cgroups(),
        _build_tools(),
        _images(),
        _free("cache", paths.cache_dir()),
        _free("state", paths.state_dir()),
    ]


def can_run_vms(checks: list[Check]) -> bool:
    return all(c.ok for c in checks if c.fatal)
