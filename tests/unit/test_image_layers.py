"""An image's layers flattened into a squashfs root (forkd.image_import.layers, tree, squash):
Docker's layer rules, every kind of entry a root file system holds, and hostile
layers refused with nothing left behind. Real tar2sqfs; images read back with
rdsquashfs (squashfs-tools-ng)."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import zstandard

from forkd.archive import ArchiveTooLarge, BadArchive, Limits, UnsafeEntry
from forkd.errors import HostToolMissing, ImageError
from forkd.image_import import squash
from forkd.image_import.layers import IMAGE_LIMITS
from forkd.image_import.model import LayerBlob, RootfsStats
from forkd.image_import.squash import build_rootfs
from tests.archive.hostile import (
    Entry,
    archive,
    device,
    directory,
    file,
    hardlink,
    pax_header,
    symlink,
)

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "tar2sqfs"], capture_output=True).returncode != 0,
    reason="tar2sqfs (squashfs-tools-ng) is not installed: ./dev.sh installs it",
)

CAPABILITY = bytes.fromhex("0100000220000000000000000000fffe80000000")  # binary, NULs, 0xff


class Image:
    """Layers written into a test's directory, flattened, and the result read back."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers: list[LayerBlob] = []
        self.out_dir = root / "out"
        self.out_dir.mkdir()
        self.out = self.out_dir / "rootfs.sqfs"
        self.work = root / "work"
        self.work.mkdir()

    def layer(self, *entries: Entry, compress: str = "gzip") -> LayerBlob:
        return self.raw(_compress(archive(*entries), compress))

    def raw(self, blob: bytes) -> LayerBlob:
        n = len(self.layers)
        path = self.root / f"blob-{n}"
        path.write_bytes(blob)
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        layer = LayerBlob(digest=digest, size=len(blob), media_type="x", path=path)
        self.layers.append(layer)
        return layer

    def build(self, limits: Limits = IMAGE_LIMITS) -> RootfsStats:
        return build_rootfs(self.layers, self.out, self.work, limits=limits)

    def listing(self) -> dict[str, list[str]]:
        """path -> [kind, mode, uid, gid, ...] as ``rdsquashfs -d`` describes it."""
        lines = _run("rdsquashfs", "-d", str(self.out)).splitlines()
        return {parts[1]: [parts[0], *parts[2:]] for parts in (line.split() for line in lines)}

    def cat(self, path: str) -> bytes:
        return subprocess.run(
            ["rdsquashfs", "-c", path, str(self.out)], capture_output=True, check=True
        ).stdout

    def stat(self, path: str) -> dict[str, str]:
        found = {}
        for line in _run("rdsquashfs", "-s", path, str(self.out)).splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line.startswith("\t"):
                found[key] = value
        return found

    def xattrs(self, path: str) -> dict[str, bytes]:
        found = {}
        for line in _run("rdsquashfs", "-x", path, str(self.out)).splitlines():
            key, _, value = line.partition("=")
            found[key] = bytes.fromhex(value[2:]) if value.startswith("0x") else value.encode()
        return found

    def refused(self, error: type[Exception], limits: Limits = IMAGE_LIMITS) -> str:
        """Flattening fails with ``error``, and leaves nothing beside where ``out`` goes."""
        with pytest.raises(error) as caught:
            self.build(limits)
        assert not self.out.exists()
        assert list(self.out_dir.iterdir()) == []
        beside = {p.name for p in self.root.iterdir() if not p.name.startswith("blob-")}
        assert beside == {"out", "work"}  # nothing written but scratch in work
        return str(caught.value)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, check=True)
    return done.stdout.decode("utf-8", "surrogateescape")


def _compress(tar: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(tar, compresslevel=1)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(tar)
    return tar


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


@pytest.fixture()
def image(tmp_path: Path) -> Image:
    return Image(tmp_path)


# ---------------------------------------------------------------------- layers


def test_gzip_zstd_and_plain_layers_stack_in_order(image: Image) -> None:
    image.layer(directory("etc"), file("etc/os", b"base"), file("etc/a", b"a"), compress="gzip")
    image.layer(file("etc/os", b"middle"), file("etc/b", b"b"), compress="zstd")
    image.layer(file("etc/os", b"top"), compress="plain")
    stats = image.build()
    assert image.cat("/etc/os") == b"top"
    assert (image.cat("/etc/a"), image.cat("/etc/b")) == (b"a", b"b")
    assert stats.layers == 3
    assert stats.entries == 4  # etc, etc/a, etc/b, etc/os
    assert stats.file_bytes == 5
    assert stats.image_bytes == image.out.stat().st_size > 0


def test_a_multi_frame_zstd_layer_is_read_whole(image: Image) -> None:
    tar = archive(file("one", b"1" * 5000), file("two", b"2" * 5000))
    frames = b"".join(
        zstandard.ZstdCompressor().compress(tar[i : i + 4096]) for i in range(0, len(tar), 4096)
    )
    image.raw(frames)
    image.build()
    assert image.cat("/two") == b"2" * 5000


def test_whiteouts_delete_files_and_directories_of_lower_layers(image: Image) -> None:
    image.layer(file("keep"), file("gone"), directory("dir"), file("dir/a"), file("dir/sub/b"))
    image.layer(file(".wh.gone", b""), file(".wh.dir", b""), file(".wh.never-there", b""))
    image.build()
    assert set(image.listing()) == {"keep"}


def test_an_opaque_directory_hides_lower_children_but_keeps_its_own(image: Image) -> None:
    image.layer(directory("d", mode=0o700), file("d/lower1"), file("d/sub/lower2"))
    image.layer(
        directory("d", mode=0o755), file("d/mine"), file("d/.wh..wh..opq", b""), file("d/mine-too")
    )
    image.build()
    names = {p for p in image.listing() if p.startswith("d/")}
    assert names == {"d/mine", "d/mine-too"}


def test_a_whiteout_does_not_hide_its_own_layers_entries_wherever_it_sits(image: Image) -> None:
    image.layer(file("a", b"lower a"), file("b", b"lower b"), file("c/lower"))
    image.layer(
        file("a", b"new a"),
        file(".wh.a", b""),
        file(".wh.b", b""),
        file("b", b"new b"),
        file("c/mine"),
        file(".wh.c", b""),
    )
    image.build()
    assert (image.cat("/a"), image.cat("/b")) == (b"new a", b"new b")
    assert {p for p in image.listing() if p.startswith("c")} == {"c", "c/mine"}


def test_a_file_replaces_a_directory_and_its_subtree_and_a_directory_a_file(image: Image) -> None:
    image.layer(directory("was-dir"), file("was-dir/child"), file("was-file", b"x"))
    image.layer(file("was-dir", b"now a file"), directory("was-file"), file("was-file/in"))
    image.build()
    listing = image.listing()
    assert listing["was-dir"][0] == "file" and "was-dir/child" not in listing
    assert listing["was-file"][0] == "dir" and "was-file/in" in listing


def test_a_directory_over_a_directory_keeps_children_and_takes_the_new_owner(image: Image) -> None:
    image.layer(directory("srv", mode=0o700), file("srv/data"))
    image.layer(directory("srv", mode=0o1777, uid=70, gid=70))
    image.build()
    assert image.listing()["srv"] == ["dir", "01777", "70", "70"]
    assert "srv/data" in image.listing()


def test_implicit_parents_are_root_owned_0755(image: Image) -> None:
    image.layer(file("deep/er/f", uid=1000, gid=1000))
    image.build()
    listing = image.listing()
    assert listing["deep"] == listing["deep/er"] == ["dir", "0755", "0", "0"]
    assert listing["deep/er/f"][2:4] == ["1000", "1000"]


def test_the_root_entry_sets_the_roots_metadata(image: Image) -> None:
    image.layer(directory("./", mode=0o700, uid=5, gid=6, mtime=1_234_567), file("f"))
    image.build()
    root = image.stat("/")
    assert (root["Access"], root["UID"].split()[0], root["GID"].split()[0]) == ("0700", "5", "6")
    assert root["Last modified"].endswith("(1234567)")


# ---------------------------------------------------------------------- hard links


def test_hard_links_share_an_inode_within_and_across_layers(image: Image) -> None:
    image.layer(file("bin/busybox", b"BB", mode=0o755), hardlink("bin/sh", "bin/busybox"))
    image.layer(hardlink("usr/bin/env", "./bin/busybox"), hardlink("usr/bin/ls", "/bin/sh"))
    stats = image.build()
    inode = image.stat("/bin/busybox")["Inode number"]
    for name in ("/bin/sh", "/usr/bin/env", "/usr/bin/ls"):
        assert image.stat(name)["Inode number"] == inode
        assert image.cat(name) == b"BB"
    assert image.stat("/bin/busybox")["Hard link count"] == "4"
    assert stats.file_bytes == 2  # one inode, counted once


def test_a_hard_link_outlives_its_first_name_whited_out_or_replaced(image: Image) -> None:
    image.layer(
        file("orig", b"content"),
        hardlink("link", "orig"),
        file("other", b"old"),
        hardlink("other-link", "other"),
    )
    image.layer(file(".wh.orig", b""), file("other", b"replaced"))
    image.build()
    assert "orig" not in image.listing()
    assert image.cat("/link") == b"content"
    assert image.cat("/other") == b"replaced"
    assert image.cat("/other-link") == b"old"
    assert image.stat("/other-link")["Inode number"] != image.stat("/other")["Inode number"]


def test_hard_links_to_symlinks_devices_and_fifos(image: Image) -> None:
    image.layer(
        symlink("s", "target"),
        device("c"),
        _fifo("p"),
        hardlink("s2", "s"),
        hardlink("c2", "c"),
        hardlink("p2", "p"),
    )
    image.build()
    listing = image.listing()
    assert listing["s2"] == ["slink", "0777", "0", "0", "target"]
    assert listing["c2"][0] == "nod" and listing["p2"][0] == "pipe"


# ---------------------------------------------------------------------- symlinks


def test_symlinks_keep_their_targets_absolute_and_relative(image: Image) -> None:
    image.layer(
        symlink("abs", "/usr/lib/x"),
        symlink("rel", "../up/and/over"),
        symlink("out", "/../../etc/passwd"),
    )
    image.build()
    listing = image.listing()
    assert listing["abs"][-1] == "/usr/lib/x"
    assert listing["rel"][-1] == "../up/and/over"
    assert listing["out"][-1] == "/../../etc/passwd"  # the guest's root, not the host's


def test_a_symlink_of_the_same_layer_is_followed_inside_the_root(image: Image) -> None:
    passwd = Path("/etc/passwd").read_bytes()
    image.layer(directory("usr/lib"))
    image.layer(
        symlink("lib", "/usr/lib"),
        symlink("up", "../../../.."),
        symlink("host-etc", "/../../etc"),
        symlink("chain", "lib"),
        file("lib/libc.so", b"libc"),
        file("up/etc/passwd", b"image's own"),
        file("host-etc/shadow", b"s"),
        file("chain/deeper/x", b"x"),
    )
    image.build()
    listing = image.listing()
    assert image.cat("/usr/lib/libc.so") == b"libc"
    assert image.cat("/etc/passwd") == b"image's own"
    assert "etc/shadow" in listing
    assert image.cat("/usr/lib/deeper/x") == b"x"
    assert listing["lib"][0] == listing["up"][0] == "slink"  # the links themselves stay
    assert Path("/etc/passwd").read_bytes() == passwd


def test_a_lower_layers_symlink_or_file_in_an_entrys_path_is_covered_by_a_directory(
    image: Image,
) -> None:
    """As Docker and containerd show it: they unpack a layer apart from the ones below,
    and overlayfs shows the directory made there over the lower symlink or file."""
    image.layer(
        directory("usr/lib"),
        file("usr/lib/keep"),
        symlink("lib", "/usr/lib"),
        symlink("up", "../../../.."),
        symlink("chain", "lib"),
        file("f", b"file"),
    )
    image.layer(
        file("lib/libc.so", b"libc"),
        file("up/etc/passwd", b"image's own"),
        file("chain/deeper/x", b"x"),
        file("f/x", b"under"),
    )
    image.build()
    listing = image.listing()
    assert listing["lib"][:4] == listing["up"][:4] == ["dir", "0755", "0", "0"]
    assert image.cat("/lib/libc.so") == b"libc" and image.cat("/up/etc/passwd") == b"image's own"
    assert image.cat("/chain/deeper/x") == b"x" and image.cat("/f/x") == b"under"
    assert {p for p in listing if p.startswith("usr/lib/")} == {"usr/lib/keep"}
    assert "etc/passwd" not in listing


def test_a_whiteout_makes_its_parents_and_never_follows_a_lower_symlink(image: Image) -> None:
    image.layer(directory("usr/lib"), file("usr/lib/foo"), symlink("lib", "usr/lib"))
    image.layer(file("lib/.wh.foo", b""), file("a/b/.wh.c", b""), file("n/.wh..wh..opq", b""))
    image.build()
    listing = image.listing()
    assert "usr/lib/foo" in listing
    for made in ("lib", "a", "a/b", "n"):
        assert listing[made] == ["dir", "0755", "0", "0"], made
    assert not [p for p in listing if p.startswith(("lib/", "a/b/", "n/"))]


def test_a_file_of_the_same_layer_used_as_a_directory_is_refused(image: Image) -> None:
    image.layer(file("f"), file("f/x"))
    assert "not one" in image.refused(BadArchive)


def test_absolute_and_dot_slash_names_are_confined_to_the_root(image: Image) -> None:
    image.layer(file("/etc/abs", b"a"), file("./etc/dot", b"d"), file("//x//./y", b"y"))
    image.build()
    assert {"etc/abs", "etc/dot", "x/y"} <= set(image.listing())
    assert not Path("/etc/abs").exists()


# ---------------------------------------------------------------------- entry kinds


def test_devices_fifos_modes_owners_and_times_are_kept(image: Image) -> None:
    image.layer(
        device("dev/null", tarfile.CHRTYPE, 1, 3),
        device("dev/sda", tarfile.BLKTYPE, 8, 0),
        _fifo("run/fifo"),
        file("bin/su", mode=0o4755, uid=0, gid=0),
        file("bin/wall", mode=0o2755, uid=0, gid=5),
        directory("tmp", mode=0o1777),
        file("home/pg/db", uid=70, gid=70, mtime=1_600_000_000),
        file("nobody", uid=65534, gid=65534),
        file("big-ids", uid=1_000_000, gid=3_000_000),
    )
    image.build()
    listing = image.listing()
    assert listing["dev/null"] == ["nod", "0666", "0", "0", "c", "1", "3"]
    assert listing["dev/sda"] == ["nod", "0666", "0", "0", "b", "8", "0"]
    assert listing["run/fifo"][0] == "pipe"
    assert listing["bin/su"][1] == "04755"
    assert listing["bin/wall"][1:4] == ["02755", "0", "5"]
    assert listing["tmp"][1] == "01777"
    assert listing["home/pg/db"][2:4] == ["70", "70"]
    assert listing["nobody"][2:4] == ["65534", "65534"]
    assert listing["big-ids"][2:4] == ["1000000", "3000000"]
    assert image.stat("/home/pg/db")["Last modified"].endswith("(1600000000)")


def test_a_time_past_2106_is_squashfs_last_second_and_the_image_still_imports(
    image: Image,
) -> None:
    image.layer(
        directory("./", mtime=1 << 36),
        file("future", mtime=5_000_000_000),
        file("far", mtime=1 << 40),
        directory("dir", mtime=1 << 36),
        file("now", mtime=1_700_000_000),
    )
    image.build()
    for path in ("/", "/future", "/far", "/dir"):
        assert image.stat(path)["Last modified"].endswith(f"({squash.MAX_TIME})"), path
    assert image.stat("/now")["Last modified"].endswith("(1700000000)")


def test_a_layer_gnu_tar_wrote_with_a_file_from_1960_imports_dated_0(image: Image) -> None:
    """GNU tar writes a time before 1970 in base-256; Docker takes such a layer."""
    image.raw(
        archive(
            file("old", mtime=-315_619_200),
            file("new", mtime=1_700_000_000),
            fmt=tarfile.GNU_FORMAT,
        )
    )
    image.build()
    assert image.stat("/old")["Last modified"].endswith("(0)")
    assert image.stat("/new")["Last modified"].endswith("(1700000000)")


def test_file_capabilities_survive_byte_for_byte_and_other_namespaces_do_not(image: Image) -> None:
    records = {
        "SCHILY.xattr.security.capability": CAPABILITY.decode("utf-8", "surrogateescape"),
        "SCHILY.xattr.user.note": "kept",
        "SCHILY.xattr.trusted.overlay.opaque": "y",
        "SCHILY.xattr.security.selinux": "system_u:object_r:bin_t",
    }
    image.layer(pax_header("usr/bin/ping", records, b"ping"))
    image.build()
    assert image.xattrs("/usr/bin/ping") == {
        "security.capability": CAPABILITY,
        "user.note": b"kept",
    }


def test_names_that_are_not_utf8_or_are_long_survive(image: Image) -> None:
    odd = "caf\udce9"  # the byte 0xe9 alone, as a Latin-1 file name
    deep = "/".join(["d" * 100] * 5) + "/" + "f" * 200
    image.layer(file(odd, b"latin1"), file(deep, b"deep"), symlink("long", "t" * 300))
    image.build()
    assert image.cat("/" + deep) == b"deep"
    assert image.listing()["long"][-1] == "t" * 300
    described = subprocess.run(["rdsquashfs", "-d", str(image.out)], capture_output=True).stdout
    assert b"caf\xe9" in described


# ---------------------------------------------------------------------- sparse and large


def test_a_10_gib_sparse_file_takes_no_scratch_disk(image: Image) -> None:
    size = 10 << 30
    records = {"GNU.sparse.map": f"0,4,{size - 4},4", "GNU.sparse.size": str(size)}
    image.layer(pax_header("var/sparse", records, b"HEADTAIL"), compress="gzip")
    stats = image.build()
    assert image.stat("/var/sparse")["File size"] == str(size)
    assert stats.file_bytes == size
    assert _disk_bytes(image.work) < 1 << 20
    assert image.out.stat().st_size < 2 << 20


def test_sparse_runs_come_back_at_their_offsets(image: Image) -> None:
    size = 3 << 20
    runs = [(100, 5), (1 << 20, 7), (size - 3, 3)]
    records = {
        "GNU.sparse.map": ",".join(f"{o},{n}" for o, n in runs),
        "GNU.sparse.size": str(size),
    }
    image.layer(pax_header("s", records, b"AAAAABBBBBBBCCC"))
    image.build()
    expected = bytearray(size)
    expected[100:105], expected[1 << 20 : (1 << 20) + 7], expected[-3:] = b"A" * 5, b"B" * 7, b"CCC"
    assert image.cat("/s") == bytes(expected)


def test_large_files_keep_their_content_and_zeros_cost_no_scratch_disk(image: Image) -> None:
    noise = os.urandom(3 << 20) + b"tail"
    zeros = bytes(96 << 20)
    mixed = b"head" + bytes(8 << 20) + bytes(1000) + b"middle" + bytes(4 << 20)  # mid-chunk
    image.layer(file("noise", noise), file("zeros", zeros), file("mixed", mixed))
    stats = image.build()
    assert hashlib.sha256(image.cat("/noise")).digest() == hashlib.sha256(noise).digest()
    assert image.cat("/zeros") == zeros
    assert image.cat("/mixed") == mixed
    assert stats.file_bytes == len(noise) + len(zeros) + len(mixed)
    assert _disk_bytes(image.work) < 8 << 20


# ---------------------------------------------------------------------- hostile layers


def test_a_name_climbing_with_dotdot_is_refused(image: Image) -> None:
    image.layer(file("ok"), file("a/../../escape"))
    message = image.refused(UnsafeEntry)
    assert image.layers[0].digest in message and "escape" in message


def test_a_whiteout_of_dotdot_is_refused(image: Image) -> None:
    image.layer(file("x"))
    image.layer(file("d/.wh..."))
    assert "layer 2/2" in image.refused(UnsafeEntry)


@pytest.mark.parametrize("target", ["not/in/image", "/etc/passwd", "../../etc/passwd"])
def test_a_hard_link_to_a_path_not_in_the_image_is_refused(image: Image, target: str) -> None:
    image.layer(file("etc/hostname"), hardlink("stolen", target))
    message = image.refused(UnsafeEntry if ".." in target else BadArchive)
    assert "stolen" in message and image.layers[0].digest in message


def test_a_hard_link_to_a_directory_is_refused(image: Image) -> None:
    image.layer(directory("d"), hardlink("link", "d"))
    assert "directory" in image.refused(BadArchive)


def test_a_symlink_loop_in_a_parent_is_refused_quickly(image: Image) -> None:
    image.layer(symlink("a", "b"), symlink("b", "a"), file("a/x"))
    started = time.monotonic()
    assert "symbolic links" in image.refused(BadArchive)
    assert time.monotonic() - started < 5


def test_a_chain_of_41_symlinks_in_a_parent_is_refused(image: Image) -> None:
    chain = [symlink(f"l{i}", f"l{i + 1}") for i in range(41)]
    image.layer(directory("l41"), *chain, file("l0/x"))
    image.refused(BadArchive)


def test_a_chain_of_40_symlinks_in_a_parent_is_followed(image: Image) -> None:
    chain = [symlink(f"l{i}", f"/l{i + 1}") for i in range(40)]
    image.layer(directory("l40"), *chain, file("l0/x", b"end"))
    image.build()
    assert image.cat("/l40/x") == b"end"


def test_a_gzip_bomb_stops_at_the_cap_quickly(image: Image) -> None:
    """Gigabytes of tar (one 1 MiB entry of zeros after another) in a few megabytes of
    gzip: refused once the layer passes the limits, long before its end."""
    entry = archive(file("z", bytes(1 << 20)))[: 512 + (1 << 20)]  # one header, no pax
    member = gzip.compress(entry * 16, compresslevel=9)  # 16 MiB of tar
    bomb = io.BytesIO(member * 256)  # gzip members one after another: 4 GiB expanded
    image.raw(bomb.getvalue())
    limits = Limits(max_entries=100_000, max_bytes=64 << 20)
    started = time.monotonic()
    image.refused(ArchiveTooLarge, limits)
    elapsed = time.monotonic() - started
    print(
        f"gzip bomb: {len(bomb.getvalue()) >> 20} MiB of gzip, 4 GiB expanded, "
        f"refused in {elapsed:.2f} s at a 64 MiB cap"
    )
    assert elapsed < 10
    assert _disk_bytes(image.work) < 1 << 20


def test_a_layer_with_too_many_entries_is_refused(image: Image) -> None:
    image.layer(*[file(f"f{i}") for i in range(50)])
    image.refused(ArchiveTooLarge, Limits(max_entries=20))


def test_the_merged_tree_is_held_to_the_entry_limit_too(image: Image) -> None:
    image.layer(*[file(f"a{i}") for i in range(15)])
    image.layer(*[file(f"b{i}") for i in range(15)])
    assert "more than 20 entries" in image.refused(ArchiveTooLarge, Limits(max_entries=20))


def test_a_directory_of_more_names_than_tar2sqfs_can_take_in_time_is_refused(
    image: Image,
) -> None:
    # tar2sqfs's cost grows with the square of a directory's size: 65,537 names in one
    # directory are refused while the layer is read, before tar2sqfs runs at all.
    from forkd.image_import.tree import MAX_DIR_ENTRIES

    image.layer(directory("d"), *[file(f"d/{i}") for i in range(MAX_DIR_ENTRIES + 1)])
    started = time.monotonic()
    said = image.refused(ArchiveTooLarge)
    assert f"a directory holds more than {MAX_DIR_ENTRIES} entries" in said
    assert time.monotonic() - started < 30


def test_the_directory_cap_counts_a_directory_s_names_not_the_image_s(
    image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.image_import import tree

    monkeypatch.setattr(tree, "MAX_DIR_ENTRIES", 10)
    for d in ("a", "b", "c"):  # 10 in each of three directories, and the root's 3
        image.layer(directory(d), *[file(f"{d}/{i}") for i in range(10)])
    image.layer(*[file(f"a/{i}", b"again") for i in range(10)])  # replaced, not added
    assert image.build().entries == 33
    image.out.unlink()
    image.layer(file("a/one-more"))
    assert "more than 10 entries (at 'one-more')" in image.refused(ArchiveTooLarge)


def test_a_truncated_layer_is_refused(image: Image) -> None:
    blob = gzip.compress(archive(file("big", os.urandom(200_000))))
    image.raw(blob[: len(blob) // 2])
    image.refused(BadArchive)


def test_a_truncated_uncompressed_layer_is_refused(image: Image) -> None:
    tar = archive(file("big", os.urandom(200_000)))
    image.raw(tar[:100_000])
    image.refused(BadArchive)


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(os.urandom(4096), id="garbage"),
        pytest.param(gzip.compress(os.urandom(4096)), id="gzip-of-garbage"),
        pytest.param(zstandard.ZstdCompressor().compress(b"\1" * 4096), id="zstd-of-garbage"),
        pytest.param(b"\x1f\x8b" + os.urandom(4096), id="broken-gzip"),
        pytest.param(b"\xfd7zXZ\0" + os.urandom(100), id="xz"),
    ],
)
def test_something_that_is_not_a_layer_is_refused(image: Image, blob: bytes) -> None:
    image.raw(blob)
    assert image.layers[0].digest in image.refused(BadArchive)


# ---------------------------------------------------------------------- the writer


def test_a_missing_tar2sqfs_names_its_package(
    image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    image.layer(file("f"))
    monkeypatch.setenv("PATH", str(image.root))
    message = image.refused(HostToolMissing)
    assert "squashfs-tools-ng" in message


def test_a_failing_tar2sqfs_leaves_no_image(image: Image, monkeypatch: pytest.MonkeyPatch) -> None:
    image.layer(file("f"))
    monkeypatch.setattr(squash, "COMPRESSOR", "no-such-compressor")
    image.refused(ImageError)


def test_progress_names_each_layer_and_the_result(image: Image) -> None:
    image.layer(file("a"))
    image.layer(file("b"))
    said: list[str] = []
    build_rootfs(image.layers, image.out, image.work, progress=said.append)
    assert said[0].startswith("layer 1/2 sha256:") and said[1].startswith("layer 2/2 ")
    assert said[-1].startswith("squashfs: 2 entries")


def _fifo(name: str) -> Entry:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = tarfile.FIFOTYPE
        info.mode = 0o644
        tar.addfile(info)

    return add
