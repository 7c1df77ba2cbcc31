"""The initramfs: static busybox, the guest's kernel modules and stage-1 init."""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess
from pathlib import Path

from forkd import hosttools
from forkd.errors import ImageError
from forkd.guest import guest_files
from forkd.guest.kernel import UnpackedKernel, module_load_order


def build(kernel: UnpackedKernel, work: Path, out: Path) -> list[str]:
    """Write ``out`` (a newc cpio archive); return the module load order."""
    busybox = hosttools.require_static_busybox()
    hosttools.require("cpio")
    tree = work / "initramfs"
    for sub in ("bin", "etc", "lib/modules", "dev", "proc", "sys"):
        (tree / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, tree / "bin" / "busybox")
    guest_files.install(guest_files.INITRAMFS_FILES, tree)  # stage one, /init

    order = module_load_order(kernel.modules_root)
    names = []
    for rel in order:
        src = kernel.modules_root / rel
        name = Path(rel).name
        if name.endswith(".xz"):
            data = lzma.decompress(src.read_bytes())
            name = name[: -len(".xz")]
        elif name.endswith(".ko"):
            data = src.read_bytes()
        else:
            raise ImageError(f"unsupported module compression: {rel}")
        (tree / "lib" / "modules" / name).write_bytes(data)
        names.append(name)
    (tree / "etc" / "forkd-modules").write_text("\n".join(names) + "\n")

    files = sorted(
        str(Path(root, entry).relative_to(tree))
        for root, dirs, filenames in os.walk(tree)
        for entry in (*dirs, *filenames)
    )
    with out.open("wb") as f:
        proc = subprocess.run(
            ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"],
            cwd=tree,
            input="\n".join(files).encode() + b"\n",
            stdout=f,
            stderr=subprocess.PIPE,
            check=False,
        )
    if proc.returncode != 0:
        raise ImageError(f"cpio failed: {proc.stderr.decode(errors='replace')}")
    return names
