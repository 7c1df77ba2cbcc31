"""The memory limit the VMs are charged against (a daemon in a container, or a limit
on the VMs' parent group), read from cgroup files the test writes in the v2 and the
v1 layouts; admission and reclaim then count what that limit leaves."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.cli import daemon as daemon_cli
from forkd.controller.services import host_memory
from forkd.vmm.jail import memory_limit
from forkd.vmm.jail.memory_limit import CgroupMemory
from tests.unit.conftest import fake_meminfo

MIB = 1 << 20


def v2_group(path: Path, limit: str, current: int, inactive_file: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.max").write_text(f"{limit}\n")
    (path / "memory.current").write_text(f"{current}\n")
    (path / "memory.stat").write_text(f"anon 1\ninactive_file {inactive_file}\nactive_file 9\n")


def v1_group(path: Path, limit: int, usage: int, inactive_file: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive_file}\n")


def test_a_container_s_v2_limit_counts_its_droppable_cache_as_available(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    v2_group(tmp_path, str(8192 * MIB), current=6000 * MIB, inactive_file=500 * MIB)
    assert memory_limit.enclosing(tmp_path) == CgroupMemory(8192, 2692)


def test_the_tighter_of_the_root_and_the_vms_parent_group_wins(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    v2_group(tmp_path, "max", current=6000 * MIB)  # the host's root: no limit
    assert memory_limit.enclosing(tmp_path, "forkd") is None  # the parent has no files
    v2_group(tmp_path / "forkd", str(2048 * MIB), current=1024 * MIB)
    assert memory_limit.enclosing(tmp_path, "forkd") == CgroupMemory(2048, 1024)
    v2_group(tmp_path, str(4096 * MIB), current=3800 * MIB)  # the container's is tighter
    assert memory_limit.enclosing(tmp_path, "forkd") == CgroupMemory(4096, 296)


def test_v1_s_memory_controller_and_its_no_limit(tmp_path: Path) -> None:
    v1_group(tmp_path / "memory", (1 << 63) - 4096, usage=5000 * MIB)  # v1's "no limit"
    assert memory_limit.enclosing(tmp_path) is None
    v1_group(tmp_path / "memory", 3072 * MIB, usage=3000 * MIB, inactive_file=100 * MIB)
    assert memory_limit.enclosing(tmp_path) == CgroupMemory(3072, 172)
    v1_group(tmp_path / "memory", 3072 * MIB, usage=4000 * MIB)  # over it: nothing left
    assert memory_limit.enclosing(tmp_path) == CgroupMemory(3072, 0)


@pytest.mark.parametrize("junk", ["", "lots\n", "-5\n"])
def test_a_file_that_says_nothing_usable_is_no_limit(tmp_path: Path, junk: str) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    v2_group(tmp_path, "max", current=0)
    (tmp_path / "memory.max").write_text(junk)
    assert memory_limit.enclosing(tmp_path) is None
    assert memory_limit.enclosing(tmp_path / "nowhere") is None


def test_admission_counts_what_the_limit_leaves_when_that_is_less(
    tmp_path: Path, meminfo: Path
) -> None:
    fake_meminfo(meminfo, 65536, 60000)  # a big host
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    v2_group(root, str(8192 * MIB), current=5000 * MIB)  # a container of 8 GiB
    watch = host_memory.MemoryWatch(dict, cgroup_root=root)
    assert watch.host() == host_memory.HostMemory(8192, 3192)
    v2_group(root, "max", current=5000 * MIB)
    assert watch.host() == host_memory.HostMemory(65536, 60000)


def test_the_daemon_s_defaults_are_sized_by_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("forkd.limits.host_memory_mib", lambda: 65536)
    monkeypatch.setattr(memory_limit, "enclosing", lambda: CgroupMemory(8192, 4000))
    assert daemon_cli.host_ram_mib() == 8192
    sized = daemon_cli._admission(None, None, 4.0, None)
    assert sized["memory_reserve_mib"] == 1024 and sized["max_guest_memory_mib"] == 4 * 8192
