"""The read-only root image: a Debian minbase tree plus forkd's guest files."""

from __future__ import annotations

import shutil
from pathlib import Path

from forkd import hosttools
from forkd.guest.initramfs import guest_file

AGENT_FILE = "forkd-agent.py"


def build_base(suite: str, variant: str, packages: list[str], out_tar: Path) -> None:
    """mmdebstrap a Debian tree into ``out_tar`` (uses the host's apt sources)."""
    hosttools.require("mmdebstrap")
    argv = ["mmdebstrap", "--quiet", "--format=tar", f"--variant={variant}"]
    if packages:
        argv.append("--include=" + ",".join(packages))
    argv += [suite, str(out_tar)]
    hosttools.run(argv, what=f"mmdebstrap of {suite} ({variant})")


def assemble(base_tar: Path, work: Path, out: Path) -> None:
    """Unpack ``base_tar``, add forkd's init and agent, squash to ``out``."""
    hosttools.require("mksquashfs")
    tree = work / "rootfs"
    tree.mkdir(parents=True)
    hosttools.run(
        ["tar", "-x", "--numeric-owner", "-f", str(base_tar), "-C", str(tree)],
        what="unpacking the base root filesystem",
    )
    opt = tree / "opt" / "forkd"
    opt.mkdir(parents=True, exist_ok=True)
    shutil.copy2(hosttools.require_static_busybox(), opt / "busybox")
    for name, mode in (("init", 0o755), (AGENT_FILE, 0o644)):
        (opt / name).write_bytes(guest_file(name))
        (opt / name).chmod(mode)
    (tree / "etc" / "inittab").write_bytes(guest_file("inittab"))
    (tree / "etc" / "hostname").write_text("forkd\n")
    resolv = tree / "etc" / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("nameserver 10.0.2.3\n")
    for sub in ("work", "mnt/lower", "mnt/rw"):
        (tree / sub).mkdir(parents=True, exist_ok=True)
    hosttools.run(
        ["mksquashfs", str(tree), str(out), "-comp", "lz4", "-noappend", "-quiet"],
        what="mksquashfs",
    )
