"""Shared directories over 9p (E2B's volumes, below the API): two forks read and write
one host directory at once; what a guest makes there is a plain host file (no symbolic
link, device or setuid bit reaches the host); a snapshot unmounts and mounts again, and
its forks mount the share too."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.vmm.vm import VM
from forkd.vmm.volumes import shares

from .conftest import Fleet

pytestmark = pytest.mark.integration

AT = "/mnt/shared"


@pytest.fixture
def share_dir() -> Iterator[Path]:
    outer = Path(tempfile.mkdtemp(prefix="forkd-share-", dir="/tmp"))  # 0700: QEMU has an fd
    inner = outer / "data"
    inner.mkdir(mode=0o777)
    inner.chmod(0o777)
    yield inner
    for path in sorted(outer.rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
    outer.rmdir()


def sh(fleet: Fleet, vm: VM, script: str) -> str:
    res = fleet.loop.run(vm.guest.exec(["/bin/sh", "-c", script]))
    assert res["exit_code"] == 0, res
    return str(res["stdout"])


def mounted(fleet: Fleet, snap: Path, share_dir: Path) -> tuple[VM, list[shares.Share]]:
    share = [shares.Share(0, share_dir, AT, name="team")]
    vm = fleet.fork(snap, shares=share)
    fleet.loop.run(shares.mount(vm.guest.exec, share))
    return vm, share


def test_two_forks_share_one_directory(fleet: Fleet, base_snapshot: Path, share_dir: Path) -> None:
    a, _ = mounted(fleet, base_snapshot, share_dir)
    b, _ = mounted(fleet, base_snapshot, share_dir)
    sh(fleet, a, f"echo from-a > {AT}/note && mkdir -p {AT}/d/e && echo deep > {AT}/d/e/f")
    assert sh(fleet, b, f"cat {AT}/note {AT}/d/e/f") == "from-a\ndeep\n"
    sh(fleet, b, f"echo from-b >> {AT}/note")
    assert sh(fleet, a, f"cat {AT}/note") == "from-a\nfrom-b\n"
    assert (share_dir / "note").read_text() == "from-a\nfrom-b\n"
    # The other slots serve an empty directory, read-only.
    out = sh(
        fleet,
        a,
        "mkdir -p /mnt/s1 && mount -t 9p -o trans=virtio forkd-share1 /mnt/s1 "
        "&& ls -A /mnt/s1 && (touch /mnt/s1/x 2>/dev/null && echo wrote || echo refused)",
    )
    assert out == "refused\n"


def test_what_a_guest_makes_stays_a_plain_file_on_the_host(
    fleet: Fleet, base_snapshot: Path, share_dir: Path
) -> None:
    a, _ = mounted(fleet, base_snapshot, share_dir)
    sh(
        fleet,
        a,
        f"cd {AT} && ln -s /etc/shadow link && echo x > suid && chown 123:456 suid "
        "&& chmod 4755 suid && mknod dev c 1 3 && mkfifo fifo",
    )
    # The guest sees what it made, kept in extended attributes.
    assert sh(fleet, a, f"stat -c '%A %u:%g' {AT}/suid") == "-rwsr-xr-x 123:456\n"
    assert (
        sh(fleet, a, f"readlink {AT}/link; stat -c %F {AT}/dev")
        == "/etc/shadow\ncharacter special file\n"
    )
    for name in ("link", "suid", "dev", "fifo"):
        st = os.lstat(share_dir / name)
        assert stat.S_ISREG(st.st_mode), name  # no link, node or pipe on the host
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), name
        assert (st.st_uid, st.st_gid) != (123, 456), name
    assert (share_dir / "link").read_bytes() == b"/etc/shadow"


def test_a_snapshot_keeps_its_source_mounted_and_its_forks_mount_afresh(
    fleet: Fleet, base_snapshot: Path, share_dir: Path
) -> None:
    a, _ = mounted(fleet, base_snapshot, share_dir)
    sh(fleet, a, f"echo before > {AT}/kept")
    snap = fleet.snapshot(a, "shares-branch")
    sh(fleet, a, f"echo after >> {AT}/kept")  # the source's mount goes on working
    # The fork's mount came dead with the snapshot (its 9p server is new): mount
    # detaches it and mounts the share again, twice over.
    child, share = mounted(fleet, snap, share_dir)
    assert sh(fleet, child, f"cat {AT}/kept") == "before\nafter\n"
    fleet.loop.run(shares.mount(child.guest.exec, share))
    sh(fleet, child, f"echo child >> {AT}/kept")
    assert sh(fleet, a, f"cat {AT}/kept") == "before\nafter\nchild\n"
    assert sh(fleet, child, f"grep -c ' {AT} 9p ' /proc/mounts") == "1\n"
