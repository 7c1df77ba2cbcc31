"""Share slots on QEMU's command line: every machine made now has them, a slot with no
share serves an empty directory read-only, a record made before them has none; and the
mount paths and slot sets a fork may be given."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.errors import Invalid, VMError
from forkd.vmm.qemu.argv import MachineConfig, RuntimePaths, build_argv
from forkd.vmm.volumes import shares
from forkd.vmm.volumes.shares import Share


def machine(slots: int) -> MachineConfig:
    return MachineConfig(
        memory_mib=256,
        vcpus=1,
        accel="tcg",
        vmlinuz=Path("/k"),
        initrd=Path("/i"),
        rootfs=Path("/r"),
        shares=slots,
    )


def fsdevs(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-fsdev"]


def test_each_slot_serves_its_share_or_an_empty_read_only_directory(tmp_path: Path) -> None:
    rt = RuntimePaths(tmp_path / "vm")
    share = Share(2, Path("/state/shared,volumes/v1/data"), "/mnt/data")
    argv = build_argv(machine(4), rt, ram_file=rt.ram, incoming=True, shares=[share])
    devs = fsdevs(argv)
    assert len(devs) == 4
    assert devs[2] == (
        "local,id=share2,path=/state/shared,,volumes/v1/data,security_model=mapped-xattr,"
        "fmode=0666,dmode=0777"
    )
    for slot in (0, 1, 3):
        assert f"path={rt.empty_share}," in devs[slot] and devs[slot].endswith(",readonly=on")
    assert "virtio-9p-device,fsdev=share3,mount_tag=forkd-share3" in argv
    readonly = Share(0, Path("/v"), "/mnt/ro", readonly=True)
    assert fsdevs(build_argv(machine(1), rt, ram_file=rt.ram, incoming=False, shares=[readonly]))[
        0
    ].endswith("readonly=on")


def test_a_machine_recorded_before_shares_has_no_slots() -> None:
    data = machine(4).to_json()
    assert data["shares"] == 4 and MachineConfig.from_json(data).shares == 4
    del data["shares"]
    old = MachineConfig.from_json(data)
    assert old.shares == 0
    assert "shares" not in old.to_json()  # its record stays as it was
    rt = RuntimePaths(Path("/run/vm"))
    assert fsdevs(build_argv(old, rt, ram_file=rt.ram, incoming=True)) == []


@pytest.mark.parametrize(
    ("path", "clean"),
    [("/mnt/data", "/mnt/data"), ("/mnt//data/./x/..", "/mnt/data"), ("//home/u", "/home/u")],
)
def test_mount_paths_are_normalised(path: str, clean: str) -> None:
    assert shares.check_guest_path(path) == clean


REFUSED = ["relative", "/", "/..", "/proc/x", "/sys", "/dev/shm", "/opt/forkd", "/a\0b"]


@pytest.mark.parametrize("path", [*REFUSED, "/a b", "/a\\b", "/" + "a/" * 600])
def test_mount_paths_that_are_refused(path: str) -> None:
    with pytest.raises(Invalid):
        shares.check_guest_path(path)


def test_slots_and_paths_must_not_clash() -> None:
    a, b = Share(0, Path("/a"), "/mnt/a"), Share(1, Path("/b"), "/mnt/b")
    shares.check_shares([a, b], 4)
    with pytest.raises(Invalid, match="at most 1"):
        shares.check_shares([a, b], 1)
    with pytest.raises(Invalid, match="slot"):
        shares.check_shares([a, Share(0, Path("/b"), "/mnt/b")], 4)
    with pytest.raises(Invalid, match="one path"):
        shares.check_shares([a, Share(1, Path("/b"), "/mnt/a")], 4)


def test_a_snapshot_made_before_shares_refuses_them() -> None:
    from forkd.vmm import vm_start

    with pytest.raises(VMError, match="before forkd had shared volumes"):
        vm_start.check_fork_shares(machine(0), [Share(0, Path("/a"), "/mnt/a")])
    vm_start.check_fork_shares(machine(0), [])
