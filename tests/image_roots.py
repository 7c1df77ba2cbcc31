"""The two roots the image tests compare: forkd's (an image imported as forkd imports
it, flattened, and read back with ``sqfs2tar``) and Docker's (``docker export`` of a
container made from the image, never started), with what Docker's init layer adds to
every container set apart."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from forkd.archive.tar_format import Kind
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.fetch import fetch_image
from forkd.image_import.layers import IMAGE_LIMITS
from forkd.image_import.model import FetchedImage, RootfsStats
from forkd.image_import.squash import build_rootfs
from forkd.oci.policy import RegistryPolicy
from tests.docker_daemon import DockerDaemon
from tests.image_trees import Difference, Entry, RootTree, compare, read_tree

# What `docker create` puts into every container's root before anything runs (moby's
# daemon/initlayer/setup_unix.go, Docker 20.10): each path unlinked and made again,
# empty files 0755 and directories 0755 (parents made as needed), root-owned, and
# /etc/mtab a symlink to /proc/mounts, whatever the image had there (a directory is
# kept). A running container has /proc, /sys, /dev/pts and /dev/shm mounted over
# them and /etc/hosts, /etc/hostname and /etc/resolv.conf bind mounted from files of
# the container's own; forkd's guest makes its own too. None of it is the image's:
# these paths are the one difference allowed, and the mtimes of the directories
# they are made in are not compared.
DOCKER_INIT_LAYER = {
    ".dockerenv": Kind.FILE,
    "etc/hostname": Kind.FILE,
    "etc/hosts": Kind.FILE,
    "etc/resolv.conf": Kind.FILE,
    "etc/mtab": Kind.SYMLINK,
    "dev/console": Kind.FILE,
    "dev/pts": Kind.DIRECTORY,
    "dev/shm": Kind.DIRECTORY,
    "proc": Kind.DIRECTORY,
    "sys": Kind.DIRECTORY,
}
DOCKER_INIT_DIRS = frozenset({"dev", "etc"})  # made by the init layer where the image lacks them


@dataclass
class Imported:
    """An image as forkd imported and flattened it."""

    fetched: FetchedImage
    stats: RootfsStats
    squashfs: Path
    fetch_secs: float
    flatten_secs: float


def forkd_import(reference: str, work: Path, docker_host: str | None = None) -> Imported:
    """``reference`` fetched into a blob store under ``work`` and flattened, as forkd's
    image service does."""
    work.mkdir(parents=True, exist_ok=True)
    store = BlobStore(work / "blobs")
    started = time.monotonic()
    fetched = fetch_image(reference, store, policy=RegistryPolicy(), docker_host=docker_host)
    fetched_at = time.monotonic()
    scratch = work / "scratch"
    scratch.mkdir(exist_ok=True)
    out = work / f"rootfs-{len(list(work.glob('rootfs-*')))}.sqfs"
    stats = build_rootfs(fetched.layers, out, scratch)
    shutil.rmtree(scratch)
    return Imported(fetched, stats, out, fetched_at - started, time.monotonic() - fetched_at)


def squashfs_view(squashfs: Path) -> RootTree:
    """forkd's image as ``sqfs2tar`` streams it."""
    proc = subprocess.Popen(["sqfs2tar", "--no-skip", str(squashfs)], stdout=subprocess.PIPE)
    return _tree_of(proc, "sqfs2tar")


def docker_view(dockerd: DockerDaemon, image: str) -> RootTree:
    """The root of a container of ``image`` as ``docker export`` streams it (the
    container is created, never started, and removed)."""
    container = dockerd.check("create", "--network", "none", image).strip()
    try:
        return _tree_of(dockerd.popen("export", container), "docker export")
    finally:
        dockerd.run("rm", "--force", container, timeout=120)


def _tree_of(proc: subprocess.Popen[bytes], what: str) -> RootTree:
    assert proc.stdout is not None
    try:
        tree = read_tree(proc.stdout.read, IMAGE_LIMITS)
        proc.stdout.read()  # what follows the end-of-archive blocks
    finally:
        proc.stdout.close()
        code = proc.wait()
    assert code == 0, f"{what} exited {code}"
    return tree


def assert_same_root(
    docker: RootTree, forkd: RootTree, allowed: frozenset[tuple[str, str]] = frozenset()
) -> None:
    """forkd's root is Docker's, but for what Docker's init layer makes and the
    ``allowed`` (path, field) differences."""
    for path, kind in DOCKER_INIT_LAYER.items():
        entry = docker.entries[path]
        assert _made_by_init_layer(entry, kind), f"{path!r} in Docker's view: {entry}"
    for path in DOCKER_INIT_DIRS - forkd.entries.keys():
        assert _made_by_init_layer(docker.entries[path], Kind.DIRECTORY), path
    skip = frozenset(DOCKER_INIT_LAYER) | (DOCKER_INIT_DIRS - forkd.entries.keys())
    found = compare(docker, forkd, skip=skip, skip_mtime=DOCKER_INIT_DIRS)
    unexpected = [d for d in found if (d.path, d.what) not in allowed]
    assert not unexpected, "forkd's root differs from Docker's:\n" + shown(unexpected)
    assert {(d.path, d.what) for d in found} == allowed


def shown(differences: list[Difference]) -> str:
    return "\n".join(str(d) for d in differences)


def _made_by_init_layer(entry: Entry, kind: Kind) -> bool:
    owned = (entry.kind, entry.uid, entry.gid) == (kind, 0, 0)
    if kind is Kind.FILE:
        return owned and entry.size == 0 and entry.mode == 0o755
    if kind is Kind.SYMLINK:
        return owned and entry.target == "/proc/mounts"
    return owned and entry.mode == 0o755
