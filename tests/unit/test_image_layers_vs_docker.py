"""Layers no Dockerfile build makes (a hand-written tool's, a hostile one's), put into a
real Docker with ``docker load`` and imported by forkd from the same ``docker save``
archive: the roots are compared as in test_image_vs_docker, every difference listed
and explained. And the comparison itself: it sees each field that differs."""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from forkd.image_import.layers import IMAGE_LIMITS
from tests import docker_daemon, oci_images
from tests.archive.hostile import Entry as TarEntry
from tests.archive.hostile import archive, device, directory, file, hardlink, pax_header, symlink
from tests.docker_daemon import DockerDaemon
from tests.image_roots import assert_same_root, docker_view, forkd_import, squashfs_view
from tests.image_trees import RootTree, compare, read_tree

pytestmark = pytest.mark.skipif(
    shutil.which("sqfs2tar") is None or shutil.which("tar2sqfs") is None,
    reason="tar2sqfs and sqfs2tar (squashfs-tools-ng) are not installed: ./dev.sh installs them",
)
MIB = 1 << 20


@pytest.fixture(scope="module")
def dockerd() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


# ---------------------------------------------------------------------- the comparison


def _tree(entries: dict[str, TarEntry]) -> RootTree:
    return read_tree(io.BytesIO(archive(*entries.values())).read, IMAGE_LIMITS)


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
    name: str, changed: TarEntry, seen: set[tuple[str, str]]
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
# overlayfs merge them; forkd's tree gives the same root (forkd.image_import.tree).
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
    # GNU tar writes a time before 1970 in base-256; Docker sets such a time to the
    # epoch as it unpacks, and forkd reads it as 0 (it used to refuse the layer).
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
        forkd_root=lambda tree: "usr/lib/x" in tree.entries and bool(tree.entries["lib"].target),
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
