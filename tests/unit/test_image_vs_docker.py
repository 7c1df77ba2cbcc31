"""An imported image's root, as forkd flattens it into squashfs, is the root Docker gives
a container of the same image: real Dockerfiles built by a real dockerd
(tests/docker_daemon.py), imported the way forkd imports them (``docker-daemon:``, then
``build_rootfs``), read back with ``sqfs2tar`` and compared with ``docker export`` of a
container made from the image, field by field: paths, kinds, modes with
setuid/setgid/sticky, owners, sizes, content, symlink targets, devices, hard link
groups, extended attributes and mtimes.

What Docker itself adds to a container (its "init layer", moby's
``daemon/initlayer``) is the only difference allowed: see :data:`DOCKER_INIT_LAYER`.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zstandard

from forkd.archive.tar_format import Kind
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.fetch import fetch_image
from forkd.image_import.layers import IMAGE_LIMITS
from forkd.image_import.model import FetchedImage, RootfsStats
from forkd.image_import.squash import build_rootfs
from forkd.oci.policy import RegistryPolicy
from tests import docker_daemon, oci_images
from tests.archive.hostile import archive, device, directory, file, hardlink, pax_header, symlink
from tests.docker_daemon import DockerDaemon
from tests.image_trees import Difference, Entry, RootTree, compare, read_tree

pytestmark = pytest.mark.skipif(
    shutil.which("sqfs2tar") is None or shutil.which("tar2sqfs") is None,
    reason="tar2sqfs and sqfs2tar (squashfs-tools-ng) are not installed: ./dev.sh installs them",
)

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
# security.capability v2 (vfs_cap_data): effective; permitted cap_net_raw and
# cap_net_bind_service; inheritable cap_chown. Binary, with NULs.
CAPABILITY = bytes.fromhex("01000002" + "00240000" + "01000000" + "00000000" + "00000000")
MIB = 1 << 20
SQUASHFS_MAX_TIME = (1 << 32) - 1

KINDS_DOCKERFILE = """\
FROM forkd-test/debian:12
# Every kind of entry, owner and mode bit, in one layer.
RUN set -e; mkdir -p /t/del/gonedir /t/opq/sub /t/empty /t/hl /t/flip/was-dir /t/flip/target; \\
    echo gone > /t/del/gone; echo kept > /t/del/kept; echo in > /t/del/gonedir/f; \\
    echo lower > /t/opq/lower; echo deeper > /t/opq/sub/x; \\
    echo shared > /t/hl/a; ln /t/hl/a /t/hl/b; ln /t/hl/a /t/hl/c; echo lower > /t/hl/lower; \\
    ln -s /t/hl/a /t/abs; ln -s ../hl/a /t/del/rel; ln -s nowhere /t/dangling; \\
    ln -s target /t/flip/was-link; touch /t/flip/was-dir/in; \\
    mknod /t/char c 1 3; mknod /t/block b 7 0; mknod /t/bigdev c 511 1048575; mkfifo /t/fifo; \\
    echo p > /t/hl/p; ln /t/hl/p /t/hl/q; \\
    touch /t/suid /t/sgid /t/o70 /t/obig /t/onobody /t/old /t/future /t/nomode; \\
    chmod 4755 /t/suid; chmod 2750 /t/sgid; mkdir -m 1777 /t/sticky; mkdir -m 2775 /t/sgid-dir; \\
    chmod 000 /t/nomode; mkdir /t/nodir; touch /t/nodir/in; chmod 000 /t/nodir; \\
    chown 70:70 /t/o70; chown 1000000:1000000 /t/obig; chown 65534:65534 /t/onobody; \\
    touch -d @1000000000 /t/old; touch -h -d @1200000000 /t/abs; touch -d @5000000000 /t/future
COPY steps.py /steps.py
RUN ["python3", "/steps.py", "capability", "names", "content"]
# Deletions (whiteouts), a directory emptied and made again (opaque), links across
# layers, a symlink that becomes a directory and a directory that becomes a symlink,
# modes and owners changed on files of the layer below.
RUN set -e; rm /t/del/gone /etc/debian_version; rm -r /t/del/gonedir; \\
    rm -rf /t/opq; mkdir /t/opq; echo new > /t/opq/new; \\
    ln /t/hl/lower /t/hl/cross; echo more >> /t/hl/c; ln /etc/os-release /t/hl/os-release; \\
    rm /t/hl/p; \\
    rm /t/flip/was-link; mkdir /t/flip/was-link; touch /t/flip/was-link/f; \\
    rm -r /t/flip/was-dir; ln -s /t/flip/target /t/flip/was-dir; \\
    chmod 6711 /t/o70; chown 1234:5678 /t/obig; rm /steps.py
WORKDIR /srv/work
COPY --chown=70:70 context.txt /srv/work/
"""

STEPS_PY = '''\
"""What the shell cannot do in a RUN line: a file capability, odd names, exact content."""
import os
import socket
import sys

for step in sys.argv[1:]:
    if step == "capability":
        with open("/t/ping", "wb") as f:
            f.write(b"ping")
        os.chmod("/t/ping", 0o755)
        os.setxattr("/t/ping", "security.capability", bytes.fromhex("CAPABILITY_HEX"))
    elif step == "names":
        os.mkdir("/t/names")
        odd = ("with space", "\\u00fcn\\u00efc\\u00f6d\\u00e9 \\u2713", "new\\nline", " lead",
               "tab\\t")
        for name in (*odd, "n" * 255):
            with open(os.path.join("/t/names", name), "w") as f:
                f.write(name)
        with open(b"/t/names/caf\\xe9", "w") as f:  # Latin-1: not UTF-8
            f.write("latin-1")
        os.symlink("/" + "t" * 300, "/t/names/long-target")
        # Docker leaves sockets out of a layer (and so does the image).
        socket.socket(socket.AF_UNIX).bind("/t/names/socket")
    elif step == "content":
        with open("/t/dense", "wb") as f:
            f.write(os.urandom(5 << 20))
        # Data, a MiB of zeros (which forkd keeps as a hole), data: read back the same.
        with open("/t/zero-run", "wb") as f:
            f.write(b"head" + bytes(1 << 20) + b"tail")
        with open("/t/empty-file", "wb"):
            pass
'''.replace("CAPABILITY_HEX", CAPABILITY.hex())

BUSYBOX_DOCKERFILE = """\
FROM forkd-test/busybox:1
RUN set -e; mkdir -p /b/d/sub; echo 1 > /b/d/f; echo 2 > /b/d/sub/g; \\
    ln -s /bin/busybox /b/abs; ln -s ../bin/busybox /b/rel; \\
    mknod /b/null c 1 3; mknod /b/loop b 7 1; mkfifo /b/fifo; \\
    echo x > /b/h1; ln /b/h1 /b/h2; chown 70:70 /b/h1; chmod 4755 /b/h1
RUN set -e; rm -rf /b/d; mkdir /b/d; touch /b/d/new; rm /b/abs; mkdir /b/abs; rm /usr/bin/wget; \\
    ln /b/h1 /b/h3
RUN set -e; truncate -s 4G /b/sparse; printf end >> /b/sparse; \\
    dd if=/dev/urandom of=/b/dense bs=1M count=3 2>/dev/null; touch -d @1000000000 /b/dense
"""


@pytest.fixture(scope="module")
def dockerd() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def kinds_image(dockerd: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("kinds-context")
    (context / "Dockerfile").write_text(KINDS_DOCKERFILE)
    (context / "steps.py").write_text(STEPS_PY)
    (context / "context.txt").write_text("copied with an owner\n")
    return dockerd.build(context, "forkd-test/vs-docker-kinds:1")


@pytest.fixture(scope="module")
def busybox_image(dockerd: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("busybox-context")
    (context / "Dockerfile").write_text(BUSYBOX_DOCKERFILE)
    return dockerd.build(context, "forkd-test/vs-docker-busybox:1")


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
    assert not unexpected, "forkd's root differs from Docker's:\n" + _shown(unexpected)
    assert {(d.path, d.what) for d in found} == allowed


def _shown(differences: list[Difference]) -> str:
    return "\n".join(str(d) for d in differences)


def _made_by_init_layer(entry: Entry, kind: Kind) -> bool:
    owned = (entry.kind, entry.uid, entry.gid) == (kind, 0, 0)
    if kind is Kind.FILE:
        return owned and entry.size == 0 and entry.mode == 0o755
    if kind is Kind.SYMLINK:
        return owned and entry.target == "/proc/mounts"
    return owned and entry.mode == 0o755


# ---------------------------------------------------------------------- the comparison


def _tree(entries: dict[str, object]) -> RootTree:
    return read_tree(io.BytesIO(archive(*entries.values())).read, IMAGE_LIMITS)  # type: ignore[arg-type]


_BASE = {
    "d": directory("d"),
    "d/f": file("d/f", b"data", uid=1, gid=2),
    "s": symlink("s", "d/f"),
    "c": device("c", tarfile.CHRTYPE, 1, 3),
    "x": file("x"),
    "t": file("t", b"t"),
    "h": hardlink("h", "t"),
}


@pytest.mark.parametrize(
    ("name", "changed", "seen"),
    [
        ("d/f", file("d/f", b"data", mode=0o4644, uid=1, gid=2), {("d/f", "mode")}),
        ("d/f", file("d/f", b"data", uid=7, gid=2), {("d/f", "uid")}),
        ("d/f", file("d/f", b"data", uid=1, gid=7), {("d/f", "gid")}),
        ("d/f", file("d/f", b"data", uid=1, gid=2, mtime=5), {("d/f", "mtime")}),
        ("d/f", file("d/f", b"DATA", uid=1, gid=2), {("d/f", "digest")}),
        ("d/f", file("d/f", b"data!", uid=1, gid=2), {("d/f", "digest"), ("d/f", "size")}),
        ("s", symlink("s", "/d/f"), {("s", "target")}),
        ("c", device("c", tarfile.CHRTYPE, 1, 5), {("c", "device")}),
        ("c", device("c", tarfile.BLKTYPE, 1, 3), {("c", "kind")}),
        ("x", pax_header("x", {"SCHILY.xattr.security.capability": "\x01"}), {("x", "xattrs")}),
        ("h", file("h", b"t"), {("h,t", "hard links")}),
        ("x", file("y"), {("x", "missing"), ("y", "extra")}),
    ],
)
def test_the_comparison_sees_each_field_that_differs(
    name: str, changed: object, seen: set[tuple[str, str]]
) -> None:
    """The comparison the tests below rely on can fail, on exactly what differs."""
    found = compare(_tree(_BASE), _tree({**_BASE, name: changed}))
    assert {(d.path, d.what) for d in found} == seen
    assert compare(_tree(_BASE), _tree(_BASE)) == []


def test_a_hole_compares_equal_to_written_zeros_and_a_byte_in_it_does_not() -> None:
    size = 3 * MIB + 5
    sparse = {"GNU.sparse.map": f"0,4,{size - 4},4", "GNU.sparse.size": str(size)}
    holed = _tree({"z": pax_header("z", sparse, b"HEADTAIL")})
    written = b"HEAD" + bytes(size - 8) + b"TAIL"
    assert compare(holed, _tree({"z": file("z", written)})) == []
    one_byte = written[: 2 * MIB] + b"\1" + written[2 * MIB + 1 :]
    assert {d.what for d in compare(holed, _tree({"z": file("z", one_byte)}))} == {"digest"}


# ---------------------------------------------------------------------- the roots


def test_an_image_with_every_kind_of_entry_is_the_root_docker_shows(
    dockerd: DockerDaemon, kinds_image: str, tmp_path: Path
) -> None:
    imported = forkd_import(f"docker-daemon:{kinds_image}", tmp_path, dockerd.host)
    forkd = squashfs_view(imported.squashfs)
    docker = docker_view(dockerd, kinds_image)
    # squashfs keeps seconds in 32 bits: a time past 2106-02-07 is its last second.
    assert_same_root(docker, forkd, allowed=frozenset({("t/future", "mtime")}))
    assert docker.entries["t/future"].mtime == 5_000_000_000
    assert forkd.entries["t/future"].mtime == SQUASHFS_MAX_TIME

    # What the comparison covered is really there (a Dockerfile that silently built
    # less would compare equal too).
    entries = forkd.entries
    assert {"t/del/gone", "t/del/gonedir", "t/opq/lower", "t/opq/sub", "etc/debian_version",
            "steps.py", "t/flip/target/in"}.isdisjoint(entries)  # fmt: skip
    assert {"t/del/kept", "t/opq/new", "t/flip/was-link/f", "t/empty", "srv/work/context.txt",
            "t/names/new\nline", "t/names/\u00fcn\u00efc\u00f6d\u00e9 \u2713",
            "t/names/tab\t"} <= set(entries)  # fmt: skip
    assert entries["t/flip/was-dir"].target == "/t/flip/target"
    assert entries["t/abs"].target == "/t/hl/a" and entries["t/abs"].mtime == 1_200_000_000
    assert entries["t/del/rel"].target == "../hl/a"
    assert entries["t/char"].device == (1, 3) and entries["t/block"].kind is Kind.BLOCK_DEVICE
    assert entries["t/bigdev"].device == (511, 1048575)
    assert entries["t/fifo"].kind is Kind.FIFO
    assert entries["t/ping"].xattrs == (("security.capability", CAPABILITY),)
    assert entries["t/suid"].mode == 0o4755 and entries["t/sgid"].mode == 0o2750
    assert entries["t/sticky"].mode == 0o1777 and entries["t/sgid-dir"].mode == 0o2775
    assert entries["t/o70"].mode == 0o6711 and entries["t/o70"].uid == 70
    assert (entries["t/obig"].uid, entries["t/obig"].gid) == (1234, 5678)
    assert entries["t/onobody"].uid == 65534 and entries["t/old"].mtime == 1_000_000_000
    assert entries["srv/work/context.txt"].uid == 70
    assert entries["t/dense"].size == 5 * MIB
    assert entries["t/nomode"].mode == entries["t/nodir"].mode == 0 and "t/nodir/in" in entries
    assert "t/names/caf\udce9" in entries and "t/names/" + "n" * 255 in entries
    assert entries["t/names/long-target"].target == "/" + "t" * 300
    assert "t/names/socket" not in docker.entries
    assert "t/hl/p" not in entries and entries["t/hl/q"].size == 2
    groups = forkd.link_groups()
    assert frozenset({"t/hl/a", "t/hl/b"}) in groups  # c was copied up when appended to
    assert frozenset({"t/hl/lower", "t/hl/cross"}) in groups
    assert frozenset({"etc/os-release", "t/hl/os-release"}) in groups  # a hard-linked symlink
    assert entries["t/hl/c"].digest != entries["t/hl/a"].digest


def test_a_busybox_image_with_a_4_gib_sparse_file_is_the_root_docker_shows(
    dockerd: DockerDaemon, busybox_image: str, tmp_path: Path
) -> None:
    imported = forkd_import(f"docker-daemon:{busybox_image}", tmp_path, dockerd.host)
    forkd = squashfs_view(imported.squashfs)
    docker = docker_view(dockerd, busybox_image)
    # No /dev, /proc or /sys in the image: Docker's init layer makes them.
    assert {"dev", "proc", "sys"}.isdisjoint(forkd.entries)
    assert_same_root(docker, forkd)

    entries = forkd.entries
    assert entries["b/sparse"].size == (4 << 30) + 3
    assert entries["b/dense"].size == 3 * MIB and entries["b/dense"].mtime == 1_000_000_000
    assert entries["b/abs"].kind is Kind.DIRECTORY and entries["b/rel"].target == "../bin/busybox"
    assert set(p for p in entries if p.startswith("b/d/")) == {"b/d/new"}
    assert "usr/bin/wget" not in entries
    # Linking h1 again copied it up, away from h2 (overlayfs does, and so Docker shows it).
    assert forkd.link_groups() == {frozenset({"b/h1", "b/h3"})}
    assert entries["b/h1"].mode == 0o4755 and entries["b/h1"].uid == 70
    # Docker's layer carries the 4 GiB of zeros; the squashfs keeps them as a hole.
    assert imported.squashfs.stat().st_size < 16 * MIB


# ---------------------------------------------------------------------- hand-made layers


@dataclass(frozen=True)
class HandMade:
    """Layers no Dockerfile build makes (a hand-written tool's, a hostile one's), put
    into Docker with ``docker load``."""

    layers: tuple[dict[str, oci_images.Entry] | bytes, ...]  # files, or a tar as it is
    docker_differs: frozenset[tuple[str, str]] = frozenset()  # (path, field), documented
    docker_refuses: str = ""  # in what ``docker load`` says
    forkd_root: Callable[[RootTree], bool] = field(default=lambda _tree: True)


_DIR, _LINK, _HARD = oci_images.Dir, oci_images.Symlink, oci_images.Hardlink

# Docker (its overlay2 graph driver) and containerd (its overlayfs snapshotter) both
# unpack a layer into a directory of its own, without the layers below, and let
# overlayfs merge them; forkd's tree gives the same root (forkd.image_import.layers).
# Where they are not deterministic or refuse, forkd differs: a parent a layer makes is
# dated 0, not when the image was loaded, so the same layers make the same image; a
# lower directory such a parent covers keeps its owner and mode (containerd copies
# them; Docker shows 0755 root:root); what both refuse is applied as the OCI layer
# spec reads.
HAND_MADE = {
    "whiteout-before-own-entry": HandMade(
        ({"f": b"old", "g": b"g"}, {".wh.f": b"", "f": b"new", ".wh.g": b""})
    ),
    "opaque-between-own-entries": HandMade(
        (
            {"d": _DIR(0o700), "d/low": b"l", "d/sub": _DIR(), "d/sub/x": b"x"},
            {"d": _DIR(0o750, 70, 70), "d/mine": b"m", "d/.wh..wh..opq": b"", "d/mine-too": b"m"},
        )
    ),
    "file-over-dir-dir-over-file": HandMade(
        (
            {"was-dir": _DIR(), "was-dir/child": b"c", "was-file": b"f"},
            {"was-dir": b"now a file", "was-file": _DIR(0o700), "was-file/in": b"i"},
        )
    ),
    "dir-over-dir": HandMade(
        ({"srv": _DIR(0o700), "srv/data": b"d"}, {"srv": _DIR(0o1777, 70, 70)})
    ),
    "missing-parents": HandMade(
        ({"a/b/f": b"x"},), docker_differs=frozenset({("a", "mtime"), ("a/b", "mtime")})
    ),
    "lower-dir-written-into-unnamed": HandMade(
        ({"srv": _DIR(0o700, 70, 70), "srv/old": b"o"}, {"srv/new": b"n"}),
        docker_differs=frozenset({("srv", f) for f in ("mode", "uid", "gid", "mtime")}),
    ),
    "lower-symlink-as-parent": HandMade(
        ({"usr": _DIR(), "usr/lib": _DIR(), "lib": _LINK("usr/lib")}, {"lib/x": b"x"}),
        docker_differs=frozenset({("lib", "mtime")}),
    ),
    "lower-file-as-parent": HandMade(
        ({"f": b"file"}, {"f/x": b"x"}), docker_differs=frozenset({("f", "mtime")})
    ),
    "whiteout-in-missing-dir": HandMade(
        ({"f": b""}, {"a/b/.wh.c": b""}),
        docker_differs=frozenset({("a", "mtime"), ("a/b", "mtime")}),
    ),
    "whiteout-through-lower-symlink": HandMade(
        (
            {"usr": _DIR(), "usr/lib": _DIR(), "usr/lib/foo": b"", "lib": _LINK("usr/lib")},
            {"lib/.wh.foo": b""},
        ),
        docker_differs=frozenset({("lib", "mtime")}),
    ),
    "opaque-in-missing-dir": HandMade(
        ({"f": b""}, {"n/.wh..wh..opq": b""}), docker_differs=frozenset({("n", "mtime")})
    ),
    # GNU tar writes a time before 1970 in base-256: both read it as 0 (forkd's image
    # cannot hold it; Docker's export is read by forkd's reader).
    "gnu-tar-1960": HandMade(
        (archive(file("old", mtime=-315_619_200), fmt=tarfile.GNU_FORMAT),),
        forkd_root=lambda tree: tree.entries["old"].mtime == 0,
    ),
    # Docker refuses these; forkd applies them as the OCI layer spec says: a whiteout
    # hides only lower layers' entries, a hard link may name one, and a layer's own
    # symlink leads where it points.
    "whiteout-after-own-entry": HandMade(
        ({"f": b"old"}, {"f": b"new", ".wh.f": b""}),
        docker_refuses="file exists",
        forkd_root=lambda tree: tree.entries["f"].size == 3,
    ),
    "hard-link-to-lower-file": HandMade(
        ({"f": b"old"}, {"g": _HARD("f")}),
        docker_refuses="no such file",
        forkd_root=lambda tree: tree.link_groups() == {frozenset({"f", "g"})},
    ),
    "own-symlink-to-lower-dir-as-parent": HandMade(
        ({"usr": _DIR(), "usr/lib": _DIR()}, {"lib": _LINK("usr/lib"), "lib/x": b"x"}),
        docker_refuses="no such file",
        forkd_root=lambda tree: "usr/lib/x" in tree.entries and tree.entries["lib"].target,
    ),
}


@pytest.mark.parametrize("case", list(HAND_MADE))
def test_hand_made_layers_match_docker_load_but_for_the_documented_differences(
    dockerd: DockerDaemon, case: str, tmp_path: Path
) -> None:
    made = HAND_MADE[case]
    tag = f"forkd-test/vs-docker-hand-made:{case}"
    layers = [
        oci_images.Layer(files, oci_images.OCI_LAYER, files)
        if isinstance(files, bytes)
        else oci_images.layer(files, "none")
        for files in made.layers
    ]
    image = oci_images.image(layers, {"Cmd": ["never-run"]}, docker=True)
    saved = oci_images.write_docker_archive(tmp_path / "image.tar", {tag: image})
    forkd = squashfs_view(forkd_import(f"docker-archive:{saved}", tmp_path / "forkd").squashfs)
    assert made.forkd_root(forkd)
    loaded = dockerd.run("load", "--input", str(saved), timeout=120)
    try:
        if made.docker_refuses:
            assert loaded.returncode != 0 and made.docker_refuses in loaded.stderr
            return
        assert loaded.returncode == 0, loaded.stderr
        assert_same_root(docker_view(dockerd, tag), forkd, allowed=made.docker_differs)
    finally:
        dockerd.run("rmi", "--force", tag, timeout=120)


# ---------------------------------------------------------------------- compression


def test_gzip_zstd_and_uncompressed_layers_give_the_same_root(
    dockerd: DockerDaemon, kinds_image: str, tmp_path: Path
) -> None:
    """The image's layers as Docker saves them (uncompressed), then recompressed into OCI
    layouts: all gzip, all zstd, and the three kinds mixed."""
    plain = forkd_import(f"docker-daemon:{kinds_image}", tmp_path / "plain", dockerd.host)
    tars = [layer.path.read_bytes() for layer in plain.fetched.layers]
    assert all(tar[257:262] == b"ustar" for tar in tars)  # Docker saved them uncompressed
    expected = squashfs_view(plain.squashfs)
    orders = {"gzip": ["gzip"], "zstd": ["zstd"], "mixed": ["none", "gzip", "zstd"]}
    for name, kinds in orders.items():
        layers = [_recompress(tar, kinds[i % len(kinds)]) for i, tar in enumerate(tars)]
        layout = oci_images.write_oci_layout(tmp_path / f"layout-{name}",
                                             {"1": oci_images.image(layers)})  # fmt: skip
        imported = forkd_import(f"oci:{layout}:1", tmp_path / name)
        kinds_seen = {layer.media_type.rpartition("+")[2] for layer in imported.fetched.layers}
        assert kinds_seen == {{"none": "application/vnd.oci.image.layer.v1.tar"}.get(k, k)
                              for k in kinds}  # fmt: skip
        differences = compare(expected, squashfs_view(imported.squashfs))
        assert not differences, f"{name}:\n{_shown(differences)}"
        stored = sum(layer.size for layer in imported.fetched.layers)
        print(f"\n{name}: layers {stored / MIB:.0f} MiB ({sum(map(len, tars)) / MIB:.0f} MiB "
              f"as tar), flattened in {imported.flatten_secs:.1f} s "
              f"({sum(map(len, tars)) / MIB / imported.flatten_secs:.0f} MiB/s of tar), "
              f"squashfs {imported.stats.image_bytes / MIB:.0f} MiB")  # fmt: skip


def _recompress(tar: bytes, kind: str) -> oci_images.Layer:
    if kind == "gzip":
        return oci_images.Layer(gzip.compress(tar, compresslevel=1, mtime=0),
                                f"{oci_images.OCI_LAYER}+gzip", tar)  # fmt: skip
    if kind == "zstd":
        return oci_images.Layer(zstandard.ZstdCompressor(level=3).compress(tar),
                                f"{oci_images.OCI_LAYER}+zstd", tar)  # fmt: skip
    return oci_images.Layer(tar, oci_images.OCI_LAYER, tar)


# ---------------------------------------------------------------------- a real base


def test_the_debian_base_is_the_root_docker_shows_and_imports_at_speed(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    """forkd-test/debian:12 (mmdebstrap's minbase with python3, ~200 MB): the whole of a
    real distribution compared; the import's speed printed (a measurement, not a bound)."""
    image = dockerd.base_image("forkd-test/debian:12")
    imported = forkd_import(f"docker-daemon:{image}", tmp_path, dockerd.host)
    forkd = squashfs_view(imported.squashfs)
    docker = docker_view(dockerd, image)
    assert_same_root(docker, forkd)
    assert len(forkd.entries) > 5000

    layer_bytes = sum(layer.size for layer in imported.fetched.layers)
    inspect = json.loads(dockerd.check("image", "inspect", image))[0]
    total = imported.fetch_secs + imported.flatten_secs
    mib = layer_bytes / MIB
    print(
        f"\n{image}: {layer_bytes / MIB:.0f} MiB of layers ({inspect['Size'] / MIB:.0f} MiB "
        f"as Docker counts it), {imported.stats.entries} entries; fetch from dockerd "
        f"{imported.fetch_secs:.1f} s, flatten {imported.flatten_secs:.1f} s, "
        f"{mib / total:.0f} MiB/s overall ({mib / imported.flatten_secs:.0f} MiB/s "
        f"flattening); squashfs {imported.stats.image_bytes / MIB:.0f} MiB "
        f"({imported.stats.image_bytes / layer_bytes:.0%} of the layers)"
    )
