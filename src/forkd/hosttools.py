"""Host programs forkd runs, and the Debian package that provides each."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from forkd.errors import ForkdError, HostToolMissing

# program -> Debian package that ships it
PACKAGES: dict[str, str] = {
    "qemu-system-x86_64": "qemu-system-x86",
    "qemu-img": "qemu-utils",
    "mkfs.ext4": "e2fsprogs",
    "mmdebstrap": "mmdebstrap",
    "mksquashfs": "squashfs-tools",
    "tar2sqfs": "squashfs-tools-ng",
    "cpio": "cpio",
    "depmod": "kmod",
    "dpkg-deb": "dpkg",
    "apt-get": "apt",
    "apt-cache": "apt",
    "tar": "tar",
    "setpriv": "util-linux",
    "nsenter": "util-linux",
    "sh": "dash",
}

BUSYBOX_STATIC = Path("/bin/busybox")


def require(tool: str) -> str:
    """Return the path of ``tool`` or raise a message naming its package."""
    path = shutil.which(tool)
    if path is None:
        raise HostToolMissing(tool, PACKAGES.get(tool, tool))
    return path


def require_static_busybox() -> Path:
    """The initramfs needs a statically linked busybox (package busybox-static)."""
    path = BUSYBOX_STATIC
    if not path.exists():
        raise HostToolMissing("busybox (static)", "busybox-static")
    if _has_interpreter(path):
        raise HostToolMissing("busybox (static)", "busybox-static")
    return path


def _has_interpreter(path: Path) -> bool:
    """True when the ELF file asks for a dynamic loader (so it is not static)."""
    data = path.read_bytes()[:65536]
    return b"/lib64/ld-linux" in data or b"/lib/ld-linux" in data


def run(argv: list[str], *, what: str, cwd: Path | None = None, input: bytes | None = None) -> str:
    """Run a host program (never through a shell); raise with its output on failure."""
    require(argv[0])
    proc = subprocess.run(argv, cwd=cwd, input=input, capture_output=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-2000:]
        raise ForkdError(f"{what} failed ({argv[0]} exited {proc.returncode}): {tail}")
    return proc.stdout.decode(errors="replace")
