"""Guest images: build (cached, content-addressed) and look up.

An image is a directory ``<cache>/images/<name>-<key>/`` holding ``vmlinuz``,
``initrd.img``, ``rootfs.sqfs`` and ``image.json``. ``key`` hashes every input
(kernel package, Debian packages, forkd's guest files), so a second build with
the same inputs is a no-op; ``<name>.json`` beside it names the newest build.
Builds happen in a staging directory that is renamed into place only when
complete, so a failed build leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from forkd import hosttools, paths
from forkd.errors import ImageError
from forkd.guest import initramfs, kernel, rootfs

BUILDER_VERSION = 1
GUEST_FILES = ("initramfs-init", "init", "inittab", rootfs.AGENT_FILE)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ImageSpec:
    """What goes into an image. Recipes (later) produce these too."""

    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: list[str] = field(default_factory=lambda: ["python3"])

    def base_key(self) -> str:
        blob = json.dumps([self.suite, self.variant, sorted(self.packages)]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


BUILTIN: dict[str, ImageSpec] = {"python": ImageSpec("python")}
DEFAULT_IMAGE = "python"


@dataclass(frozen=True)
class Image:
    name: str
    key: str
    dir: Path
    meta: dict

    @property
    def vmlinuz(self) -> Path:
        return self.dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.sqfs"

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())


def _image_key(spec: ImageSpec, kpkg: kernel.KernelPackage) -> str:
    h = hashlib.sha256()
    h.update(f"builder={BUILDER_VERSION}\nkernel={kpkg.key}\nbase={spec.base_key()}\n".encode())
    for name in GUEST_FILES:
        h.update(name.encode() + b"\0" + initramfs.guest_file(name) + b"\0")
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
        if not (as_dir / "image.json").is_file():
            raise ImageError(f"{as_dir} is not a forkd image directory")
        return _load(as_dir)
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


def build(name: str = DEFAULT_IMAGE, progress: Progress | None = None) -> Image:
    """Build image ``name`` unless a build with the same inputs exists."""
    say = progress or (lambda _msg: None)
    spec = BUILTIN.get(name)
    if spec is None:
        raise ImageError(f"unknown image {name!r}: built-in images are {', '.join(BUILTIN)}")
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
        _write_atomic(root / f"{name}.json", json.dumps({"key": key}))
        say(f"image {name} is up to date ({key})")
        return _load(final)

    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".staging-{name}-"))
    try:
        out = staging / "image"
        out.mkdir()
        say(f"fetching {kpkg.name} {kpkg.version}")
        deb = kernel.fetch(kpkg, cache / "downloads")
        say("unpacking the kernel and resolving modules")
        unpacked = kernel.unpack(deb, staging / "kernel")
        shutil.copy2(unpacked.vmlinuz, out / "vmlinuz")
        say("building the initramfs")
        modules = initramfs.build(unpacked, staging, out / "initrd.img")

        base = cache / "bases" / f"{spec.suite}-{spec.variant}-{spec.base_key()}.tar"
        if not base.is_file():
            say(f"mmdebstrap {spec.suite} {spec.variant} + {' '.join(spec.packages)}")
            base.parent.mkdir(parents=True, exist_ok=True)
            tmp_tar = base.with_name(f".partial-{base.name}")
            try:
                rootfs.build_base(spec.suite, spec.variant, spec.packages, tmp_tar)
                tmp_tar.rename(base)
            finally:
                tmp_tar.unlink(missing_ok=True)
        say("assembling the root image (squashfs)")
        rootfs.assemble(base, staging, out / "rootfs.sqfs")

        meta = {
            "name": name,
            "key": key,
            "kernel_package": kpkg.key,
            "kernel_release": unpacked.release,
            "modules": modules,
            "suite": spec.suite,
            "packages": spec.packages,
            "builder_version": BUILDER_VERSION,
            "built_at_unix": int(time.time()),
            "build_secs": round(time.monotonic() - started, 1),
        }
        (out / "image.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            out.rename(final)
        except OSError:
            if not (final / "image.json").is_file():  # lost a race to an identical build
                raise
        _write_atomic(root / f"{name}.json", json.dumps({"key": key}))
        say(f"built image {name} ({key}) in {meta['build_secs']} s")
        return _load(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
