"""Guest images made from container images: the image's layers as the root disk, forkd's
runtime disk beside it, forkd's kernel and initramfs.

An imported image is a directory ``<cache>/images/<name>-<key>/`` like a recipe's
(``vmlinuz``, ``initrd.img``, ``rootfs.sqfs``, ``image.json``) plus
``runtime.sqfs`` (hard-linked from the one runtime, see :mod:`forkd.guest.runtime`).
``name`` is ``oci-`` and the first 12 hex digits of the image's config digest
(its image id, as ``docker images`` shows it); ``key`` hashes what the build is
made of: that digest, every layer's checked diff_id (the digest of the tar it was
found to hold) in order, the kernel and the runtime. So importing the same image
again, from any source, finds it built, and an image that shares only its config's
bytes with another (other layers under the same image id) never does: a build is
reused only when every input matches. The
reference it was imported as, its config and its layers' digests are in
``image.json``. Built in a staging directory renamed into place only when
complete, like a recipe image.
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
from pathlib import Path
from typing import Any

from forkd import file_lock, hosttools, paths, processes
from forkd.disk_reserve import DiskReserve
from forkd.guest import guest_files, kernel, recipe, runtime
from forkd.guest import image as images
from forkd.image_import.model import FetchedImage, ImageConfig, RootfsStats

BUILDER_VERSION = 2  # 2: the key holds the layers' checked diff_ids, not the config alone
KIND = "container"  # image.json's "kind" for an imported image (a recipe image has none)
RUNTIME_FILE = "runtime.sqfs"

Progress = Callable[[str], None]
# Writes the root disk (a squashfs image) at its first argument, using the second as
# scratch space: the layers flattened, or (tests) any tree.
RootfsWriter = Callable[[Path, Path], RootfsStats]


def image_name(config_digest: str) -> str:
    return "oci-" + config_digest.removeprefix("sha256:")[:12]


def is_container(img: images.Image) -> bool:
    return img.meta.get("kind") == KIND


def config_of(img: images.Image) -> ImageConfig:
    """An imported image's config (empty for a recipe image)."""
    return ImageConfig.from_json(img.meta.get("config") or {})


def find(reference: str, manifest_digest: str | None = None) -> images.Image | None:
    """The newest import of ``reference`` (of that manifest, when given), if any."""
    found = [
        img
        for img in images.list_images()
        if is_container(img)
        and reference in img.meta.get("references", ())
        and (manifest_digest is None or img.meta.get("manifest_digest") == manifest_digest)
    ]
    return max(found, key=lambda i: i.meta.get("built_at_unix", 0)) if found else None


def build(
    fetched: FetchedImage,
    progress: Progress | None = None,
    max_bytes: int | None = None,
    *,
    run_as: tuple[int, int] | None = None,
    reserve: DiskReserve | None = None,
    worker_started: Callable[[int], None] | None = None,
    max_entries: int | None = None,
) -> images.Image:
    """The guest image of ``fetched``, its layers flattened (unless built already);
    ``max_bytes`` caps what its files expand to (default ``forkd.limits.MAX_IMAGE_BYTES``),
    ``max_entries`` its entries (``forkd.limits.MAX_IMAGE_ENTRIES``);
    ``run_as`` (uid, gid): the squashfs writer runs as that user, not the daemon's;
    ``reserve``: the free disk the flattening may not take; ``worker_started`` is told
    the pid of the process that flattens the layers."""
    from forkd.image_import import flatten_worker  # the flattener: where an image is made
    from forkd.image_import.layers import image_limits

    limits = image_limits(max_bytes, max_entries)

    def write(out: Path, work: Path) -> RootfsStats:  # in a worker process: hostile input
        return flatten_worker.build_rootfs(
            fetched.layers,
            out,
            work,
            limits=limits,
            progress=progress,
            run_as=run_as,
            reserve=reserve,
            started=worker_started,
        )

    identity = {
        "reference": fetched.reference,
        "manifest_digest": fetched.manifest_digest,
        "config_digest": fetched.config_digest,
        "layers": [layer.digest for layer in fetched.layers],
        "diff_ids": [layer.diff_id for layer in fetched.layers],
    }
    return assemble(fetched.config_digest, fetched.config, identity, write, progress)


def assemble(
    config_digest: str,
    config: ImageConfig,
    identity: dict[str, Any],
    write_rootfs: RootfsWriter,
    progress: Progress | None = None,
) -> images.Image:
    """Build (or find) the image directory whose root disk ``write_rootfs`` makes.

    ``identity`` goes into image.json as it is (reference, digests); its
    ``reference`` is added to an existing build's references. Its ``diff_ids`` (each
    layer's checked tar) are part of the build's key with ``config_digest``.
    """
    say = progress or (lambda _msg: None)
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "depmod", "cpio", "mmdebstrap", "mksquashfs"):
        hosttools.require(tool)
    cache = paths.cache_dir()
    root = paths.images_dir()
    root.mkdir(parents=True, exist_ok=True)
    kpkg = kernel.resolve(cache / "kernel-package.json")
    spec = recipe.builtin(images.DEFAULT_IMAGE)  # the Debian base the runtime's Python is of
    base_key = spec.base_key(images.VARIANT)
    kernel_key = f"{kpkg.key} boot={images.boot_key(kpkg)}"  # the kernel as booted
    key = _build_key(kernel_key, runtime.key(base_key), config_digest, identity)
    name = image_name(config_digest)
    final = root / f"{name}-{key}"
    if (final / "image.json").is_file():
        _add_reference(final, identity.get("reference"))
        images.make_current(root, name, key)
        say(f"image {name} is up to date ({key})")
        return images.find_image(str(final), root)

    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".staging-{name}-{processes.mark()}"))
    try:
        out = staging / "image"
        out.mkdir()
        boot = images.boot_files(kpkg, cache, staging, out, say)
        base = images.base_tarball(spec, cache, staging, say)
        _link(runtime.build(base, base_key, cache, say), out / RUNTIME_FILE)
        say("flattening the image's layers into the root disk")
        (staging / "layers").mkdir()
        stats = write_rootfs(out / "rootfs.sqfs", staging / "layers")
        meta = _image_meta(name, key, identity, config, boot, stats, started)
        images.commit_build(out, final, meta)
        say(f"built image {name} ({key}) in {meta['build_secs']} s")
        return images.find_image(str(final), root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build_key(
    kernel_key: str, runtime_key: str, config_digest: str, identity: dict[str, Any]
) -> str:
    """What a build is made of, hashed: the builder, the kernel, the runtime, the image's
    config and layers, and the initramfs's files."""
    h = hashlib.sha256()
    for part in (BUILDER_VERSION, kernel_key, runtime_key, config_digest):
        h.update(f"{part}\n".encode())
    # The tars each layer was checked to hold, in order: the same image fetched from
    # any source (its layers compressed or not) is one build.
    h.update(json.dumps({"diff_ids": identity.get("diff_ids") or []}).encode() + b"\n")
    guest_files.digest(h, guest_files.INITRAMFS_FILES)  # stage 1, in the initramfs
    return h.hexdigest()[:16]


def _image_meta(
    name: str,
    key: str,
    identity: dict[str, Any],
    config: ImageConfig,
    boot: dict[str, Any],
    stats: RootfsStats,
    started: float,
) -> dict[str, Any]:
    """The image.json of a build begun at ``started`` (``time.monotonic``)."""
    reference = identity.get("reference")
    return {
        "name": name,
        "key": key,
        "kind": KIND,
        **identity,
        "references": [reference] if reference else [],
        "config": config.to_json(),
        **boot,
        "rootfs": {
            "layers": stats.layers,
            "entries": stats.entries,
            "file_bytes": stats.file_bytes,
            "image_bytes": stats.image_bytes,
        },
        "template": {},
        "builder_version": BUILDER_VERSION,
        "built_at_unix": int(time.time()),
        "build_secs": round(time.monotonic() - started, 1),
    }


def _link(source: Path, target: Path) -> None:
    """``target`` as a hard link of ``source`` (one copy on disk), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _add_reference(image_dir: Path, reference: str | None) -> None:
    """Record that ``reference`` names the build in ``image_dir`` too (image.json, atomically)."""
    if reference:
        _change_references(
            image_dir, lambda refs: refs if reference in refs else [*refs, reference]
        )


def drop_references(img: images.Image, dropped: set[str]) -> None:
    """Record that the references ``dropped`` no longer name ``img`` (an untag)."""
    _change_references(img.dir, lambda refs: [r for r in refs if r not in dropped])


def _change_references(image_dir: Path, change: Callable[[list[str]], list[str]]) -> None:
    """``image.json``'s references changed by ``change``, read and replaced under a lock
    every process on the host takes for it (an import adding one and a removal taking
    one off, in two daemons, never lose either)."""
    with file_lock.locked(image_dir.parent / ".references.lock"):
        _change_references_locked(image_dir, change)


def _change_references_locked(image_dir: Path, change: Callable[[list[str]], list[str]]) -> None:
    path = image_dir / "image.json"
    meta = json.loads(path.read_text())
    before = list(meta.get("references", []))
    after = change(before)
    if after == before:
        return
    meta["references"] = after
    fd, tmp = tempfile.mkstemp(dir=image_dir, prefix=".image.json.")
    with contextlib.ExitStack() as undo:
        undo.callback(lambda: Path(tmp).unlink(missing_ok=True))
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        undo.pop_all()


LOCAL_SOURCES = ("loaded:", "docker-daemon:")  # names a client sent or this host's engine had
FILE_SOURCES = ("docker-archive:", "oci-archive:", "oci:")  # paths: no name to find it by


def with_tag(name: str) -> str:
    """``name`` with ``:latest`` when it has no tag nor digest, as Docker reads it."""
    if "@" in name:
        return name
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def local_names(img: images.Image) -> dict[str, str]:
    """The names ``--image`` finds an imported image by, each with the reference it came
    from: the tag it was loaded or built with (``loaded:myapp:1``, ``docker-daemon:myapp:1``
    give ``myapp:1``) and the registry reference it was imported as."""
    names: dict[str, str] = {}
    for ref in img.meta.get("references") or []:
        name = local_names_of(ref)
        if name is not None:
            names.setdefault(name, ref)
    return names


def local_names_of(reference: object) -> str | None:
    """The local name one reference of an image gives it, if any (see :func:`local_names`)."""
    if not isinstance(reference, str) or reference.startswith(FILE_SOURCES):
        return None
    if reference == "loaded:archive":  # loaded without a tag
        return None
    name = reference
    for prefix in LOCAL_SOURCES:
        name = name.removeprefix(prefix)
    return with_tag(name)


def collect_unused_layers() -> int:
    """Free the blobs (layers, configs, manifests) no imported image needs; bytes freed."""
    from forkd.image_import.blob_store import BlobStore

    root = paths.blobs_dir()
    if not root.is_dir():
        return 0
    return BlobStore(root).remove_unreferenced(_needed_blobs)


def forget_blobs(digests: set[str]) -> int:
    """Remove the blobs ``digests`` (of an import refused after its fetch) that no built
    image needs and no import in progress holds: whole and checked as they are, nothing
    would ever list or free them; the bytes freed."""
    from forkd.image_import.blob_store import BlobStore

    return BlobStore(paths.blobs_dir()).remove_unreferenced(_needed_blobs, among=digests)


def _needed_blobs() -> set[str]:
    keep: set[str] = set()
    for img in images.list_images():
        if is_container(img):
            keep.update(img.meta.get("layers") or [])
            digests = (img.meta.get("manifest_digest"), img.meta.get("config_digest"))
            keep.update(d for d in digests if d)
    return keep
