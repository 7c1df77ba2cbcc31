"""The one extractor (forkd.archive.unpack) against hostile archives: nothing lands,
points or links outside the target, whatever the archive says."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from forkd.archive import (
    DATA,
    ROOTFS,
    ArchiveError,
    ArchiveTooLarge,
    BadArchive,
    ChunkReader,
    Extracted,
    Limits,
    Policy,
    UnsafeEntry,
    extract,
    extract_new,
)
from forkd.archive.tar_format import TarReader
from tests.archive.hostile import (
    archive,
    chunks,
    device,
    directory,
    file,
    hardlink,
    path_max_chain,
    pax_header,
    symlink,
)

NO_LIMITS = Limits()
POLICIES = [pytest.param(DATA, id="data"), pytest.param(ROOTFS, id="rootfs")]


@pytest.fixture()
def dest(tmp_path: Path) -> Path:
    d = tmp_path / "dest"
    d.mkdir()
    return d


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A directory beside the target with a file in it, which no archive may touch."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_text("original")
    return d


def unpack(data: bytes, dest: Path, policy: Policy = DATA, limits: Limits = NO_LIMITS) -> Extracted:
    return extract(io.BytesIO(data).read, dest, policy, limits)


def tree(root: Path) -> dict[str, str]:
    """Every name under ``root`` with what it is (links not followed)."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISLNK(st.st_mode):
            found[rel] = "-> " + os.readlink(path)
        elif stat.S_ISDIR(st.st_mode):
            found[rel] = "dir"
        else:
            found[rel] = path.read_bytes().decode(errors="replace")
    return found


def assert_untouched(tmp_path: Path, outside: Path, before: dict[str, str]) -> None:
    assert (outside / "victim").read_text() == "original"
    after = {k: v for k, v in tree(tmp_path).items() if not k.startswith("dest")}
    assert after == before


def outside_view(tmp_path: Path) -> dict[str, str]:
    return {k: v for k, v in tree(tmp_path).items() if not k.startswith("dest")}


# ---------------------------------------------------------------------- a plain round trip


def test_a_tree_comes_back_as_it_was(dest: Path) -> None:
    data = archive(
        directory("docs"),
        file("docs/readme.txt", b"hello\n", mode=0o640),
        file("run.sh", b"#!/bin/sh\n", mode=0o755),
        file("empty", b""),
        symlink("docs/latest", "readme.txt"),
        symlink("docs/up", "../run.sh"),
        hardlink("docs/copy.txt", "docs/readme.txt"),
        file("deep/er/still.txt", b"parents made on the way"),
        file("caf\u00e9 \u2603.txt", b"unicode"),
    )
    done = unpack(data, dest)
    assert (dest / "docs/readme.txt").read_bytes() == b"hello\n"
    assert stat.S_IMODE((dest / "docs/readme.txt").stat().st_mode) == 0o640
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o755
    assert (dest / "empty").read_bytes() == b""
    assert os.readlink(dest / "docs/latest") == "readme.txt"
    assert (dest / "docs/up").read_bytes() == b"#!/bin/sh\n"
    assert (dest / "docs/copy.txt").stat().st_ino == (dest / "docs/readme.txt").stat().st_ino
    assert (dest / "deep/er/still.txt").read_text() == "parents made on the way"
    assert (dest / "caf\u00e9 \u2603.txt").read_bytes() == b"unicode"
    assert int((dest / "run.sh").stat().st_mtime) == 1_700_000_000
    assert done.entries == 9
    assert done.bytes == len(b"hello\n#!/bin/sh\nparents made on the wayunicode")


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar", "v7"])
def test_gnu_tar_archives_of_every_format_unpack(tmp_path: Path, dest: Path, fmt: str) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f.bin").write_bytes(os.urandom(70_000))
    (src / "x").write_text("short")
    long_dir = src / ("n" * 120)
    long_dir.mkdir()
    (long_dir / ("m" * 120)).write_text("a name longer than ustar's 100 bytes")
    os.symlink("a/b/f.bin", src / "link")
    os.link(src / "x", src / "x-again")
    if fmt in ("ustar", "v7"):  # names over 100 (v7) or 255 (ustar) bytes do not fit
        (long_dir / ("m" * 120)).unlink()
        long_dir.rmdir()
    data = subprocess.run(
        ["tar", f"--format={fmt}", "-C", str(src), "-cf", "-", "."], check=True, capture_output=True
    ).stdout
    unpack(data, dest)
    assert tree(dest) == tree(src)


@pytest.mark.parametrize("version", ["gnu", "0.0", "0.1", "1.0"])
def test_sparse_files_keep_their_holes_and_size(tmp_path: Path, dest: Path, version: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    sparse = src / "disk.img"
    with sparse.open("wb") as f:
        f.seek(3 << 20)
        f.write(b"middle")
        f.seek(9 << 20)
        f.write(b"end")
    argv = ["tar", "--sparse", "-C", str(src), "-cf", "-", "disk.img"]
    argv[1:1] = (
        ["--format=gnu"] if version == "gnu" else ["--format=posix", f"--sparse-version={version}"]
    )
    data = subprocess.run(argv, check=True, capture_output=True).stdout
    assert len(data) < 1 << 20  # the holes are not in the archive
    done = unpack(data, dest)
    out = dest / "disk.img"
    assert out.read_bytes() == sparse.read_bytes()
    assert out.stat().st_blocks * 512 < 1 << 20  # nor on the disk
    assert done.bytes == sparse.stat().st_size


def test_a_read_only_directory_still_gets_its_content(dest: Path) -> None:
    unpack(archive(directory("ro", mode=0o555), file("ro/inside", b"written")), dest)
    assert (dest / "ro/inside").read_text() == "written"
    assert stat.S_IMODE((dest / "ro").stat().st_mode) == 0o755  # owner may write (data)


def test_chunks_of_any_size_unpack_the_same(dest: Path) -> None:
    data = archive(file("a", os.urandom(5000)), file("b/c", b"c" * 1030))
    extract(ChunkReader(chunks(data, 7)).read, dest)
    assert (dest / "b/c").read_bytes() == b"c" * 1030


# ---------------------------------------------------------------------- names


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "name", ["../escaped", "a/../../escaped", "/tmp/absolute", "a/b/../../../escaped"]
)
def test_names_that_climb_or_are_absolute_are_refused(
    tmp_path: Path, dest: Path, outside: Path, policy: Policy, name: str
) -> None:
    before = outside_view(tmp_path)
    with pytest.raises(UnsafeEntry, match="refusing entry"):
        unpack(archive(file(name, b"evil")), dest, policy)
    assert_untouched(tmp_path, outside, before)


def test_a_nul_in_a_name_is_refused(dest: Path) -> None:
    with pytest.raises(UnsafeEntry, match="NUL"):
        unpack(archive(pax_header("ok", {"path": "a\x00b"})), dest)


# ---------------------------------------------------------------------- symlinks


@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_is_written_through_a_symlink(
    tmp_path: Path, dest: Path, outside: Path, policy: Policy
) -> None:
    before = outside_view(tmp_path)
    data = archive(symlink("link", "../outside"), file("link/victim", b"evil"))
    with pytest.raises(UnsafeEntry):
        unpack(data, dest, policy)
    assert_untouched(tmp_path, outside, before)


def test_a_rootfs_keeps_any_symlink_but_never_follows_one(
    tmp_path: Path, dest: Path, outside: Path
) -> None:
    before = outside_view(tmp_path)
    data = archive(
        symlink("abs", str(outside)),
        symlink("rel", "../../../../outside"),
        symlink("lib", "usr/lib"),
        directory("usr/lib"),
        file("usr/lib/x.so", b"elf"),
    )
    unpack(data, dest, ROOTFS)
    assert os.readlink(dest / "abs") == str(outside)
    assert os.readlink(dest / "rel") == "../../../../outside"
    assert (dest / "lib/x.so").read_bytes() == b"elf"
    with pytest.raises(UnsafeEntry, match="symlink"):
        unpack(archive(file("abs/victim", b"evil")), dest, ROOTFS)
    assert_untouched(tmp_path, outside, before)


def test_a_symlink_placed_before_the_archive_is_not_followed(
    tmp_path: Path, dest: Path, outside: Path
) -> None:
    before = outside_view(tmp_path)
    os.symlink(outside, dest / "planted")
    with pytest.raises(UnsafeEntry, match="symlink"):
        unpack(archive(file("planted/victim", b"evil")), dest)
    assert_untouched(tmp_path, outside, before)


@pytest.mark.parametrize(
    "target",
    ["/etc/passwd", "..", "../outside/victim", "a/../../x", "a/b/../../../x", "a/..", "./a/../a"],
)
def test_data_symlinks_must_point_inside(dest: Path, target: str) -> None:
    with pytest.raises(UnsafeEntry, match="symlink"):
        unpack(archive(directory("a"), symlink("l", target)), dest)


@pytest.mark.parametrize(
    ("name", "target"), [("l", "a"), ("l", "./a/./b"), ("d/e/l", "../../a"), ("d/e/l", "../x/y")]
)
def test_data_symlinks_may_climb_first_then_descend(dest: Path, name: str, target: str) -> None:
    unpack(archive(symlink(name, target)), dest)
    assert os.readlink(dest / name) == target


def test_a_later_symlink_cannot_make_an_earlier_one_lead_out(dest: Path) -> None:
    # "e" -> "s/..", lexically the root itself; then "s" -> "." would make it the
    # parent: a '..' after a name is refused as written.
    with pytest.raises(UnsafeEntry, match="after a name"):
        unpack(archive(symlink("e", "s/.."), symlink("s", ".")), dest)
    assert list(dest.iterdir()) == []


def test_a_later_archive_cannot_make_an_earlier_link_lead_out(
    tmp_path: Path, dest: Path, outside: Path
) -> None:
    """Two copies into one directory: the first's link leads inside as the tree then
    stands, the second turns the directory it climbs out of into a link to the root.
    Judged afresh, each archive alone was fine; the link must be refused as written,
    or the second copy (or a write through it later) would reach ``outside``."""
    before = outside_view(tmp_path)
    first = archive(directory("d/e/up"), symlink("x", "d/e/up/../../../outside/victim"))
    with pytest.raises(UnsafeEntry, match="after a name"):
        unpack(first, dest)
    unpack(archive(symlink("d/e/up", "../..")), dest)
    assert not (dest / "x").is_symlink()
    assert_untouched(tmp_path, outside, before)


def test_a_symlink_can_replace_a_symlink_and_an_empty_directory(dest: Path) -> None:
    unpack(archive(symlink("l", "a"), symlink("l", "b"), directory("d"), symlink("d", "b")), dest)
    assert os.readlink(dest / "l") == "b"
    assert os.readlink(dest / "d") == "b"


def test_a_file_cannot_replace_a_directory_with_content(dest: Path) -> None:
    with pytest.raises(BadArchive, match="not empty"):
        unpack(archive(file("d/inner"), file("d", b"flat")), dest)


# ---------------------------------------------------------------------- hard links


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("target", ["../outside/victim", "/etc/passwd", "via/victim"])
def test_hard_links_reach_nothing_outside(
    tmp_path: Path, dest: Path, outside: Path, policy: Policy, target: str
) -> None:
    before = outside_view(tmp_path)
    entries = [hardlink("h", target), file("h", b"overwritten")]
    if target.startswith("via/"):
        entries.insert(0, symlink("via", str(outside)))
    with pytest.raises(UnsafeEntry):
        unpack(archive(*entries), dest, policy)
    assert_untouched(tmp_path, outside, before)


def test_writing_a_hard_linked_name_never_writes_through_it(
    tmp_path: Path, dest: Path, outside: Path
) -> None:
    # A name in the target that is already a hard link to a file outside it.
    os.link(outside / "victim", dest / "planted")
    unpack(
        archive(file("planted", b"evil"), hardlink("again", "planted"), file("again", b"evil too")),
        dest,
    )
    assert (outside / "victim").read_text() == "original"
    assert (dest / "planted").read_bytes() == b"evil"
    assert (dest / "again").read_bytes() == b"evil too"


@pytest.mark.parametrize("kind", ["directory", "missing", "device"])
def test_hard_links_to_what_is_not_a_file_are_refused(dest: Path, kind: str) -> None:
    first = {"directory": directory("d"), "missing": file("other"), "device": None}[kind]
    if kind == "device":
        os.mkfifo(dest / "d")
    entries = [first] if first else []
    with pytest.raises(UnsafeEntry, match="hard link"):
        unpack(archive(*entries, hardlink("h", "d")), dest)


# ---------------------------------------------------------------------- published attacks


@pytest.mark.parametrize("policy", POLICIES)
def test_the_path_max_chain_of_cve_2025_4517_writes_nothing_outside(
    tmp_path: Path, dest: Path, outside: Path, policy: Policy
) -> None:
    before = outside_view(tmp_path)
    with pytest.raises(UnsafeEntry):
        unpack(archive(*path_max_chain(str(outside))), dest, policy)
    assert_untouched(tmp_path, outside, before)


# ---------------------------------------------------------------------- devices, owners, bits


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_data_refuses_devices_and_fifos(dest: Path, kind: bytes) -> None:
    with pytest.raises(UnsafeEntry, match="only files, directories and links"):
        unpack(archive(device("dev", kind)), dest)
    assert not (dest / "dev").exists()


def test_data_drops_setuid_and_owners(dest: Path) -> None:
    unpack(archive(file("suid", b"x", mode=0o4777, uid=1234, gid=5678)), dest)
    st = (dest / "suid").stat()
    assert stat.S_IMODE(st.st_mode) == 0o755
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


@pytest.mark.skipif(os.geteuid() != 0, reason="owners and device nodes need root")
def test_rootfs_keeps_owners_bits_devices_and_capabilities(dest: Path) -> None:
    data = archive(
        file("bin/ping", b"elf", mode=0o4755, uid=0, gid=0),
        pax_header(
            "bin/cap",
            {"SCHILY.xattr.security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00" + "\x00" * 12},
        ),
        file("home/u/own", b"mine", mode=0o600, uid=1000, gid=1001),
        directory("tmp", mode=0o1777),
        device("dev/null", tarfile.CHRTYPE, 1, 3),
        device("run/fifo", tarfile.FIFOTYPE),
    )
    unpack(data, dest, ROOTFS)
    assert stat.S_IMODE((dest / "bin/ping").stat().st_mode) == 0o4755
    assert (dest / "home/u/own").stat().st_uid == 1000
    assert (dest / "home/u/own").stat().st_gid == 1001
    assert stat.S_IMODE((dest / "tmp").stat().st_mode) == 0o1777
    null = (dest / "dev/null").lstat()
    assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1
    assert stat.S_ISFIFO((dest / "run/fifo").lstat().st_mode)
    try:
        assert os.getxattr(dest / "bin/cap", "security.capability")[:4] == b"\x01\x00\x00\x02"
    except OSError as exc:  # a file system without xattrs (tmpfs without user_xattr...)
        pytest.skip(f"the test's file system keeps no extended attributes: {exc}")


# ---------------------------------------------------------------------- bounds


def test_too_many_entries(dest: Path) -> None:
    data = archive(*(file(f"f{i}") for i in range(11)))
    with pytest.raises(ArchiveTooLarge, match="more than 10 entries"):
        unpack(data, dest, limits=Limits(max_entries=10))


def test_too_many_bytes_is_refused_before_they_are_written(dest: Path) -> None:
    data = archive(file("a", b"a" * 600), file("b", b"b" * 600))
    with pytest.raises(ArchiveTooLarge, match="more than 1000 bytes"):
        unpack(data, dest, limits=Limits(max_bytes=1000))
    assert not (dest / "b").exists()


def test_a_sparse_file_counts_its_holes(tmp_path: Path, dest: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with (src / "big").open("wb") as f:
        f.truncate(1 << 30)
    data = subprocess.run(
        ["tar", "--sparse", "-C", str(src), "-cf", "-", "big"], check=True, capture_output=True
    ).stdout
    with pytest.raises(ArchiveTooLarge):
        unpack(data, dest, limits=Limits(max_bytes=1 << 20))


def test_a_huge_extended_header_is_refused_unread(dest: Path) -> None:
    data = archive(pax_header("f", {"comment": "c" * 5000}))
    with pytest.raises(ArchiveTooLarge, match="extended header"):
        unpack(data, dest, limits=Limits(max_header_bytes=4096))


def test_long_names_and_deep_trees_are_bounded(dest: Path) -> None:
    with pytest.raises(ArchiveTooLarge, match="longer than"):
        unpack(archive(file("n" * 300)), dest, limits=Limits(max_path_bytes=200))
    with pytest.raises(ArchiveTooLarge, match="deep"):
        unpack(archive(file("a/" * 20 + "f")), dest, limits=Limits(max_depth=10))


def test_extended_headers_cannot_pile_up(dest: Path) -> None:
    one = archive(pax_header("f", {"comment": "x"}))
    header_and_payload = one[:1024]  # the pax header block and its payload block
    data = header_and_payload * 20 + one
    with pytest.raises(BadArchive, match="extended headers"):
        unpack(data, dest)


# ---------------------------------------------------------------------- malformed


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"not a tar at all" * 40, id="text"),
        pytest.param(archive(file("a", b"a" * 2000))[:1100], id="truncated content"),
        pytest.param(archive(file("a"))[:300], id="truncated header"),
    ],
)
def test_what_is_not_a_tar_is_a_bad_archive(dest: Path, data: bytes) -> None:
    with pytest.raises(BadArchive):
        unpack(data, dest)


def test_a_negative_size_is_refused(dest: Path) -> None:
    from tests.archive.hostile import raw_header

    with pytest.raises(BadArchive, match="negative"):
        unpack(raw_header(b"f", size_field=b"\xff" * 12) + bytes(1024), dest)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_a_time_before_1970_reads_as_0(fmt: int) -> None:
    """GNU tar writes it in base-256 (a first byte of 0xff), pax as a negative record."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, mtime in (("old", -315_619_200), ("just-before", -1), ("new", 1_700_000_000)):
            info = tarfile.TarInfo(name)
            info.mtime = mtime
            tar.addfile(info, io.BytesIO(b""))
    reader = TarReader(io.BytesIO(out.getvalue()).read, Limits())
    assert [(m.name, m.mtime) for m in reader] == [
        ("old", 0),
        ("just-before", 0),
        ("new", 1_700_000_000),
    ]


def test_an_unknown_entry_type_is_refused(dest: Path) -> None:
    from tests.archive.hostile import raw_header

    with pytest.raises(BadArchive, match="type"):
        unpack(raw_header(b"f", kind=b"Z") + bytes(1024), dest)


# ---------------------------------------------------------------------- staged


def test_extract_new_leaves_nothing_when_refused(tmp_path: Path, outside: Path) -> None:
    target = tmp_path / "new"
    with pytest.raises(ArchiveError):
        extract_new(io.BytesIO(archive(file("ok"), file("../bad"))).read, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside"]


def test_extract_new_renames_a_whole_tree_into_place(tmp_path: Path) -> None:
    extract_new(io.BytesIO(archive(file("a/b", b"c"))).read, tmp_path / "new")
    assert (tmp_path / "new/a/b").read_bytes() == b"c"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_content_hidden_in_entries_without_any_is_counted(dest: Path) -> None:
    # A directory whose header claims content: skipped, but not for free.
    from tests.archive.hostile import raw_header

    body = raw_header(b"d/", kind=b"5", size_field=b"00000010000\0") + bytes(4096)
    with pytest.raises(ArchiveTooLarge):
        unpack(body + bytes(1024), dest, limits=Limits(max_bytes=1000))


def test_a_stream_of_padding_past_its_entries_is_cut_off(dest: Path) -> None:
    # Blocks of headers that each replace the last (a compressed bomb of them).
    one = archive(pax_header("f", {"comment": "x"}))[:1024]
    limits = Limits(max_entries=2, max_bytes=1024, max_header_bytes=1024)
    with pytest.raises((ArchiveTooLarge, BadArchive)):
        unpack(one * 1000, dest, limits=limits)
