"""The guest kernel: Debian's generic kernel, fetched with apt and unpacked.

Not the smaller cloud kernel: that one has no 9p, and E2B's shared volumes
reach the guest as 9p over virtio (:mod:`forkd.vmm.volumes.shares`). The
generic kernel is xz-compressed, which a TCG guest takes four seconds to
undo at every boot, so the image holds it decompressed: the ELF ``vmlinux``,
which QEMU starts at its PVH entry (:func:`uncompressed`).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from forkd import hosttools
from forkd.errors import ImageError

META_PACKAGE = "linux-image-amd64"

# Modules the guest needs, in the order they are wanted; dependencies are
# added in front of each from modules.dep.
WANTED_MODULES = (
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "virtio-rng",
    "squashfs",
    "overlay",
    "ext4",  # forkd's volumes (built in to the cloud kernel, a module here)
    "crc32c_generic",  # ext4's metadata checksums: asked for by name, not in modules.dep
    "9pnet_virtio",  # E2B's shared volumes
    "9p",
)


@dataclass(frozen=True)
class KernelPackage:
    name: str  # e.g. linux-image-6.1.0-57-amd64
    version: str  # Debian version, e.g. 6.1.192-3

    @property
    def key(self) -> str:
        return f"{self.name}={self.version}"


APT_LISTS = Path("/var/lib/apt/lists")


def resolve(cache: Path | None = None) -> KernelPackage:
    """The concrete kernel package the meta-package points at.

    Asking apt takes about a second, so the answer is kept in ``cache``
    until apt's package lists change (or the meta-package does).
    """
    lists = str(APT_LISTS.stat().st_mtime_ns) if APT_LISTS.exists() else ""
    stamp = f"{META_PACKAGE}@{lists}" if lists else ""
    if cache is not None and cache.is_file():
        try:
            saved = json.loads(cache.read_text())
            if saved.get("stamp") == stamp and stamp:
                return KernelPackage(saved["name"], saved["version"])
        except (ValueError, KeyError):
            pass
    pkg = _ask_apt()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "name": pkg.name, "version": pkg.version}))
        tmp.replace(cache)
    return pkg


def _ask_apt() -> KernelPackage:
    out = hosttools.run(["apt-cache", "depends", META_PACKAGE], what="resolving the kernel")
    match = re.search(r"Depends:\s*(linux-image-\S+)", out)
    if not match:
        raise ImageError(
            f"apt does not know {META_PACKAGE}; run 'apt-get update' first "
            "(the installer does this)"
        )
    name = match.group(1)
    policy = hosttools.run(["apt-cache", "policy", name], what="resolving the kernel version")
    vmatch = re.search(r"Candidate:\s*(\S+)", policy)
    if not vmatch or vmatch.group(1) == "(none)":
        raise ImageError(f"no installable version of {name}: run 'apt-get update'")
    return KernelPackage(name, vmatch.group(1))


def fetch(pkg: KernelPackage, downloads: Path) -> Path:
    """Download the kernel .deb into ``downloads`` (cached); return its path."""
    downloads.mkdir(parents=True, exist_ok=True)
    existing = sorted(downloads.glob(f"{pkg.name}_*.deb"))
    want = pkg.version.replace(":", "%3a")
    for deb in existing:
        if f"_{want}_" in deb.name:
            return deb
    staging = downloads / f".fetch-{pkg.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        hosttools.run(
            ["apt-get", "download", f"{pkg.name}={pkg.version}"],
            what=f"downloading {pkg.name}",
            cwd=staging,
        )
        debs = list(staging.glob("*.deb"))
        if len(debs) != 1:
            raise ImageError(f"apt-get download left {len(debs)} files for {pkg.name}")
        final = downloads / debs[0].name
        debs[0].rename(final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class UnpackedKernel:
    vmlinuz: Path
    release: str  # uname -r, e.g. 6.1.0-57-amd64
    modules_root: Path  # .../lib/modules/<release>


def unpack(deb: Path, dest: Path) -> UnpackedKernel:
    """Unpack the .deb into ``dest`` and build its modules.dep with depmod."""
    hosttools.run(["dpkg-deb", "-x", str(deb), str(dest)], what="unpacking the kernel")
    vmlinuz = sorted((dest / "boot").glob("vmlinuz-*"))
    if not vmlinuz:
        raise ImageError(f"{deb.name} holds no vmlinuz")
    release = vmlinuz[0].name.removeprefix("vmlinuz-")
    modules_root = dest / "lib" / "modules" / release
    hosttools.run(["depmod", "-b", str(dest), release], what="depmod")
    return UnpackedKernel(vmlinuz[0], release, modules_root)


def module_load_order(modules_root: Path, wanted: tuple[str, ...] = WANTED_MODULES) -> list[str]:
    """Module files (relative to ``modules_root``) in an order insmod accepts.

    modules.dep lists, for each module, the modules it needs; each wanted
    module comes after everything it depends on, each file once.
    """
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_root / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[_module_name(path)] = path
    builtin = {_module_name(p) for p in (modules_root / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(path: str, stack: tuple[str, ...]) -> None:
        if path in order:
            return
        if path in stack:
            raise ImageError(f"module dependency cycle at {path}")
        for dep in deps.get(path, []):
            visit(dep, (*stack, path))
        order.append(path)

    for name in wanted:
        norm = name.replace("-", "_")
        if norm in builtin:
            continue
        module = by_name.get(norm)
        if module is None:
            raise ImageError(f"kernel module {name} is neither built in nor shipped")
        visit(module, ())
    return order


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for suffix in (".ko.xz", ".ko.zst", ".ko.gz", ".ko"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")
