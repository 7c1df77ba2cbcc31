"""A volume's archive unpacked by a child that dropped to a uid of its own
(forkd.archive.confined, forkd.vmm.jail.archive), as a root daemon does it."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.archive import Limits, UnsafeEntry
from forkd.vmm.jail import archive as archive_jail
from forkd.vmm.jail import qemu_user
from forkd.vmm.jail.qemu_user import UidRange
from tests.archive.hostile import archive, directory, file, symlink

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")

UIDS = UidRange(71000, 71009)
LIMITS = Limits(max_entries=100, max_bytes=1 << 20, max_header_bytes=1 << 16)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "uids"
    qemu_user.configure(UIDS, directory)
    yield directory
    qemu_user.configure(qemu_user.DEFAULT_RANGE)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    # As the daemon's staging: the parents are closed to the child's uid.
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    (staging / "content").mkdir()
    return staging / "content"


def test_the_child_unpacks_as_the_uid_it_was_given_and_not_as_root(tree: Path) -> None:
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    os.fchown(fd, 71005, 71005)
    data = archive(directory("d"), file("d/a.txt", b"alpha"), symlink("l", "d/a.txt"))
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "forkd.archive.confined",
                "--root-fd",
                str(fd),
                "--uid",
                "71005",
                "--gid",
                "71005",
                "--max-entries",
                "10",
                "--max-bytes",
                "1000",
                "--max-header-bytes",
                "4096",
            ],
            input=data,
            capture_output=True,
            pass_fds=(fd,),
            check=True,
        )
    finally:
        os.close(fd)
    answer = json.loads(proc.stdout)
    assert answer == {"ok": True, "entries": 3, "bytes": 5, "uid": 71005}
    st = (tree / "d" / "a.txt").stat()
    assert (st.st_uid, st.st_gid) == (71005, 71005)


def test_the_child_refuses_to_stay_root(tree: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "forkd.archive.confined",
            "--root-fd",
            "0",
            "--uid",
            "0",
            "--gid",
            "0",
            "--max-entries",
            "1",
            "--max-bytes",
            "1",
            "--max-header-bytes",
            "1",
        ],
        capture_output=True,
        input=b"",
        check=False,
    )
    assert proc.returncode == 2 and b"unprivileged" in proc.stderr


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_what_the_child_unpacked_belongs_to_root_and_its_uid_is_free_again(
    registry: Path, tree: Path, gz: bool
) -> None:
    data = archive(directory("d", mode=0o700), file("d/a.txt", b"alpha"), symlink("l", "d"))
    done = archive_jail.unpack(gzip.compress(data) if gz else data, tree, LIMITS)
    assert (done.entries, done.bytes) == (3, 5)
    for path in (tree, tree / "d", tree / "d" / "a.txt", tree / "l"):
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (0, 0), path
    assert (tree / "l" / "a.txt").read_bytes() == b"alpha"
    # The uid is free again once the extraction is over.
    assert qemu_user.Registry(UIDS, registry).holder(done_uid(registry)) is None


def done_uid(registry: Path) -> int:
    """The uid the last extraction took: the one before the registry's next."""
    following = int(next(registry.glob(".next*")).read_text())
    return following - 1 if following > UIDS.first else UIDS.last


def test_a_refused_archive_is_the_same_refusal_from_the_child(registry: Path, tree: Path) -> None:
    with pytest.raises(UnsafeEntry, match=r"refusing entry '\.\./x'"):
        archive_jail.unpack(archive(file("../x", b"evil")), tree, LIMITS)
    assert not (tree.parent.parent / "x").exists()


def test_a_file_on_the_host_is_given_as_the_childs_input(
    registry: Path, tree: Path, tmp_path: Path
) -> None:
    upload = tmp_path / "upload.tar"  # root's, 0600: the child reads it from its stdin
    upload.write_bytes(archive(file("big", b"z" * 70_000)))
    upload.chmod(0o600)
    archive_jail.unpack(upload, tree, LIMITS)
    assert (tree / "big").read_bytes() == b"z" * 70_000
