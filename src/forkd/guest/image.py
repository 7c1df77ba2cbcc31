"""Guest images: build (cached, content-addressed) and look up.

An image is a directory ``<cache>/images/<name>-<key>/`` holding ``vmlinuz``,
``initrd.img``, ``rootfs.sqfs`` and ``image.json``. ``key`` hashes every input
(kernel package, Debian packages, forkd's guest files), so a second build with
the same inputs is a no-op; ``<name>.json`` beside it names the newest build.
``vmlinuz`` and ``initrd.img`` are hard links of the pair made once per kernel
and initramfs in ``<cache>/boot/<key>/`` (:func:`boot_files`).
Builds happen in a staging directory that is renamed into place only when
complete, so a failed build leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd import hosttools, paths, processes
from forkd.errors import ImageError
from forkd.guest import guest_files, image_sharing, initramfs, kernel, recipe, rootfs, vmlinux
from forkd.guest.recipe import Recipe
from forkd.vmm import runtime_meta
from forkd.vmm.snapshot import files as snapshot_files

BUILDER_VERSION = 1

Progress = Callable[[str], None]


VARIANT = "minbase"
DEFAULT_IMAGE = "python"


@dataclass(frozen=True)
class Image:
    name: str
    key: str
    dir: Path
    meta: dict[str, Any]

    @property
    def vmlinuz(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.sqfs"

    @property
    def runtime(self) -> Path | None:
        """An imported container image's runtime disk (forkd's agent and its Python)."""
        path = self.dir / "runtime.sqfs"
        return path if path.is_file() else None

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())


def _image_key(spec: Recipe, kpkg: kernel.KernelPackage) -> str:
    h = hashlib.sha256()
    base = spec.base_key(VARIANT)
    h.update(f"builder={BUILDER_VERSION}\nkernel={kpkg.key}\nbase={base}\n".encode())
    h.update(f"boot={boot_key(kpkg)}\n".encode())  # the kernel as booted, the initramfs
    h.update(json.dumps(spec.template, sort_keys=True).encode())
    guest_files.digest(h, guest_files.GUEST_FILES)
    busybox = hosttools.require_static_busybox()
    h.update(hashlib.sha256(busybox.read_bytes()).digest())
    return h.hexdigest()[:16]


def _load(d: Path) -> Image:
    meta = json.loads((d / "image.json").read_text())
    return Image(meta["name"], meta["key"], d, meta)


def list_images(images: Path | None = None) -> list[Image]:
    root = images or paths.images_dir()
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and (d / "image.json").is_file():
            try:
                out.append(_load(d))
            except (OSError, ValueError, KeyError):
                continue
    return out


def find_image(name_or_dir: str, images: Path | None = None) -> Image:
    """The newest build of image ``name``, or the image in directory ``name_or_dir``."""
    root = images or paths.images_dir()
    as_dir = Path(name_or_dir)
    if as_dir.is_absolute():
        # Only image directories of this cache: never an arbitrary host path.
        real = Path(os.path.realpath(as_dir))
        if real.parent != Path(os.path.realpath(root)) or not (real / "image.json").is_file():
            raise ImageError(f"{as_dir} is not an image directory under {root}")
        return _load(real)
    if not recipe.NAME_RE.fullmatch(name_or_dir):
        raise ImageError(f"invalid image name {name_or_dir!r}")
    pointer = root / f"{name_or_dir}.json"
    if not pointer.is_file():
        raise ImageError(
            f"image {name_or_dir!r} is not built: run 'forkd image build {name_or_dir}'"
        )
    key = json.loads(pointer.read_text())["key"]
    d = root / f"{name_or_dir}-{key}"
    if not (d / "image.json").is_file():
        raise ImageError(f"image {name_or_dir!r} points at missing build {d}")
    return _load(d)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def base_tarball(spec: Recipe, cache: Path, staging: Path, say: Progress) -> Path:
    """The Debian base of ``spec`` (cached across images: mmdebstrap takes a minute)."""
    base = cache / "bases" / f"{spec.suite}-{VARIANT}-{spec.base_key(VARIANT)}.tar"
    if not base.is_file():
        extras = " ".join([*spec.apt_packages(), *(f"pip:{p}" for p in spec.pip)])
        say(f"mmdebstrap {spec.suite} {VARIANT} + {extras} (a minute or so)")
        base.parent.mkdir(parents=True, exist_ok=True)
        tmp_tar = base.with_name(f".partial-{base.name}")
        try:
            rootfs.build_base(spec, VARIANT, tmp_tar, staging)
            tmp_tar.rename(base)
        finally:
            tmp_tar.unlink(missing_ok=True)
    return base


BOOT_FILES = ("vmlinuz", "initrd.img")


def boot_key(kpkg: kernel.KernelPackage) -> str:
    """What a kernel and initramfs are made of: the kernel package, stage 1, busybox,
    and the code that assembles the initramfs (its modules, its layout)."""
    h = hashlib.sha256(f"builder={BUILDER_VERSION}\nkernel={kpkg.key}\n".encode())
    guest_files.digest(h, guest_files.INITRAMFS_FILES)
    # initramfs: its layout; kernel: the modules it holds; vmlinux: the kernel as booted
    for source in (initramfs.__file__, kernel.__file__, vmlinux.__file__):
        h.update(Path(str(source)).read_bytes() + b"\0")
    h.update(hashlib.sha256(hosttools.require_static_busybox().read_bytes()).digest())
    return h.hexdigest()[:16]


def boot_files(
    kpkg: kernel.KernelPackage, cache: Path, staging: Path, out: Path, say: Progress
) -> dict[str, Any]:
    """Put ``vmlinuz`` and ``initrd.img`` into ``out``; return what image.json says of them.

    They are made once per kernel and initramfs, in ``<cache>/boot/<key>/``
    (unpacking the kernel package takes seconds), and hard-linked into each image.
    """
    built = cache / "boot" / boot_key(kpkg)
    if not (built / "boot.json").is_file():
        _make_boot_files(kpkg, cache, staging, built, say)
    for name in BOOT_FILES:
        _link(built / name, out / name)
    return dict(json.loads((built / "boot.json").read_text()))


def _make_boot_files(
    kpkg: kernel.KernelPackage, cache: Path, staging: Path, built: Path, say: Progress
) -> None:
    """Make ``built``: staged beside it, renamed in when whole (an identical one that won a
    race is kept)."""
    built.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=built.parent, prefix=f".staging-{built.name}-"))
    try:
        say(f"fetching {kpkg.name} {kpkg.version}")
        deb = kernel.fetch(kpkg, cache / "downloads")
        say("unpacking the kernel and resolving modules")
        unpacked = kernel.unpack(deb, staging / "kernel")
        kernel_format = _place_kernel(unpacked.vmlinuz, stage / "vmlinuz")
        say("building the initramfs")
        modules = initramfs.build(unpacked, staging, stage / "initrd.img")
        meta = {
            "kernel_package": kpkg.key,
            "kernel_release": unpacked.release,
            "kernel_format": kernel_format,
            "modules": modules,
        }
        (stage / "boot.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            stage.rename(built)
        except OSError:
            if not (built / "boot.json").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _place_kernel(vmlinuz: Path, dest: Path) -> str:
    """Put the kernel a guest boots at ``dest``: the ELF inside ``vmlinuz`` where it can be
    taken out (:mod:`forkd.guest.vmlinux`), else ``vmlinuz`` itself. Returns which."""
    elf = vmlinux.unpacked_elf(vmlinuz.read_bytes())
    if elf is None:
        shutil.copy2(vmlinuz, dest)
        return "bzimage"
    dest.write_bytes(elf)
    return "elf-pvh"


def _link(source: Path, target: Path) -> None:
    """``target`` as a hard link of ``source`` (one copy on disk), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def commit_build(out: Path, final: Path, meta: dict[str, Any]) -> None:
    """Write ``image.json`` into the staged build ``out`` and rename it to ``final``: the
    image appears whole or not at all (an identical build that won a race is kept).
    It becomes the build its name finds (:func:`make_current`)."""
    (out / "image.json").write_text(json.dumps(meta, indent=2) + "\n")
    try:
        out.rename(final)
    except OSError:
        if not (final / "image.json").is_file():  # lost a race to an identical build
            raise
    make_current(final.parent, meta["name"], meta["key"])


def make_current(root: Path, name: str, key: str) -> None:
    """Make build ``key`` the one :func:`find_image` finds for ``name``: recipe and
    container images alike, so a snapshot names either by the name the list shows."""
    _write_atomic(root / f"{name}.json", json.dumps({"key": key}))


def build(
    name: str = DEFAULT_IMAGE,
    progress: Progress | None = None,
    *,
    recipe_dir: Path | None = None,
) -> Image:
    """Build a built-in image, or the recipe in ``recipe_dir``, unless already built.

    The same inputs give the same key, so a second build is a no-op.
    """
    say = progress or (lambda _msg: None)
    spec = recipe.load(recipe_dir) if recipe_dir is not None else recipe.builtin(name)
    name = spec.name
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "depmod", "cpio", "mmdebstrap", "mksquashfs"):
        hosttools.require(tool)
    hosttools.require_static_busybox()

    cache = paths.cache_dir()
    root = paths.images_dir()
    root.mkdir(parents=True, exist_ok=True)
    say("resolving the guest kernel")
    kpkg = kernel.resolve(cache / "kernel-package.json")
    key = _image_key(spec, kpkg)
    final = root / f"{name}-{key}"
    if (final / "image.json").is_file():
        make_current(root, name, key)
        say(f"image {name} is up to date ({key})")
        return _load(final)

    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".staging-{name}-{processes.mark()}"))
    try:
        out = staging / "image"
        out.mkdir()
        boot = boot_files(kpkg, cache, staging, out, say)

        base = base_tarball(spec, cache, staging, say)
        say("assembling the root image (squashfs)")
        rootfs.assemble(base, staging, out / "rootfs.sqfs")

        meta = {
            "name": name,
            "key": key,
            **boot,
            "suite": spec.suite,
            "description": spec.description,
            "packages": spec.apt_packages(),
            "pip": list(spec.pip),
            "template": spec.template,
            "recipe_dir": str(spec.dir) if spec.dir else None,
            "builder_version": BUILDER_VERSION,
            "built_at_unix": int(time.time()),
            "build_secs": round(time.monotonic() - started, 1),
        }
        commit_build(out, final, meta)
        say(f"built image {name} ({key}) in {meta['build_secs']} s")
        return _load(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def users_of(img: Image, roots: list[Path]) -> list[str]:
    """Snapshots and VMs under ``roots`` whose snapshot.json / vm.json name ``img``."""
    found = []
    for root in roots:
        for kind, recorded in (
            ("snapshot", snapshot_files.recorded_images(root)),
            ("VM", runtime_meta.recorded_images(root)),
        ):
            found += [f"{kind} {name}" for name, ref in recorded.items() if ref.dir == str(img.dir)]
    return found


def with_other_daemons(roots: list[Path]) -> list[Path]:
    """``roots`` and the snapshot and VM directories of every other daemon recorded on
    this cache (:mod:`forkd.guest.image_sharing`): where an image may be in use."""
    return [*roots, *(r for r in image_sharing.recorded_roots() if r not in roots)]


def remove(name: str, roots: list[Path] | None = None) -> list[Path]:
    """Delete image builds named ``name`` (or the one build ``name``-``key``).

    Refused, deleting nothing, while a snapshot or VM under ``roots`` (default:
    this host's snapshot root and runtime directory), or under those of any daemon
    recorded on this cache (:mod:`forkd.guest.image_sharing`), still uses one of them.
    """
    if roots is None:
        snap_root = os.environ.get("FORKD_SNAPSHOT_ROOT")
        roots = [Path(snap_root) if snap_root else paths.state_dir() / "snapshots", paths.run_dir()]
    roots = with_other_daemons(roots)
    builds = [i for i in list_images() if name in (i.name, f"{i.name}-{i.key}")]
    if not builds:
        raise ImageError(f"no image {name!r} is built (see 'forkd image ls')")
    users = {str(i.dir): users_of(i, roots) for i in builds}
    busy = {d: u for d, u in users.items() if u}
    if busy:
        detail = "; ".join(f"{Path(d).name}: {', '.join(u)}" for d, u in busy.items())
        raise ImageError(f"image in use, nothing removed ({detail})")
    root = paths.images_dir()
    for img in builds:
        trash = root / f".removing-{img.dir.name}"
        img.dir.rename(trash)  # atomic: the build vanishes at once, then is deleted
        shutil.rmtree(trash, ignore_errors=True)
        pointer = root / f"{img.name}.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads(pointer.read_text())["key"] == img.key:
                pointer.unlink()
    return [i.dir for i in builds]
