from __future__ import annotations

from pathlib import Path

from forkd.vmm.qemu_argv import (
    MachineConfig,
    RuntimePaths,
    build_argv,
    host_tsc_khz,
    kernel_cmdline,
)

CFG = MachineConfig(
    memory_mib=256,
    vcpus=1,
    accel="tcg",
    vmlinuz=Path("/img/vmlinuz"),
    initrd=Path("/img/initrd.img"),
    rootfs=Path("/img/rootfs.sqfs"),
)


def _devices(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]


def test_restore_presents_the_same_devices_as_boot() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    boot = build_argv(CFG, rt, ram_file=rt.ram, incoming=False)
    restore = build_argv(CFG, rt, ram_file=Path("/snap/memory.bin"), incoming=True)
    assert _devices(boot) == _devices(restore)
    assert "-incoming" not in boot
    assert restore[restore.index("-incoming") + 1] == "defer"
    assert "migration.send-configuration=off" in restore
    # No RARPs or guest-sent gratuitous ARPs after the load: a fork's link is new.
    assert "migration.announce-rounds=0" in restore
    assert not any("announce" in a for a in boot)


def test_ram_is_a_private_file_mapping() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    argv = build_argv(CFG, rt, ram_file=Path("/snap/memory.bin"), incoming=True)
    backend = next(a for a in argv if a.startswith("memory-backend-file"))
    assert "mem-path=/snap/memory.bin" in backend
    assert "share=off" in backend
    assert "readonly" not in backend  # QEMU 7.2 would map the RAM read-only too


def test_accelerator_flags() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    tcg = build_argv(CFG, rt, ram_file=rt.ram, incoming=False)
    assert tcg[tcg.index("-accel") + 1].startswith("tcg,tb-size=")
    kvm_cfg = MachineConfig(**{**CFG.__dict__, "accel": "kvm"})
    kvm = build_argv(kvm_cfg, rt, ram_file=rt.ram, incoming=False)
    assert kvm[kvm.index("-accel") + 1] == "kvm"
    assert kvm[kvm.index("-cpu") + 1] == "host"


def test_no_internet_restricts_the_nat() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    cfg = MachineConfig(**{**CFG.__dict__, "internet": False})
    argv = build_argv(cfg, rt, ram_file=rt.ram, incoming=False)
    assert argv[argv.index("-netdev") + 1] == "user,id=net0,restrict=on"


def test_tcg_guests_are_told_the_tsc_rate(tmp_path: Path) -> None:
    """Without it a busy host makes PIT calibration fail and the guest hang at boot."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2596.122\n")
    assert host_tsc_khz(cpuinfo) == 2596122
    assert kernel_cmdline("tcg", 2596122).endswith(" tsc_early_khz=2596122")
    assert "tsc_early_khz" not in kernel_cmdline("kvm", 2596122)
    # TCG runs rep movsb a byte at a time: the guest kernel must not copy with it.
    assert "clearcpuid=erms" in kernel_cmdline("tcg", 2596122).split()
    # Idle guests: no TSC watchdog (TCG's TSC is the host's), no PSI averaging.
    assert {"tsc=reliable", "psi=0"} <= set(kernel_cmdline("tcg", 2596122).split())
    assert "tsc=reliable" not in kernel_cmdline("kvm") and "psi=0" in kernel_cmdline("kvm")
    assert "clearcpuid" not in kernel_cmdline("kvm", 2596122)
    cfg = MachineConfig(**{**CFG.__dict__, "cmdline": kernel_cmdline("tcg", 1000)})
    argv = build_argv(cfg, RuntimePaths(Path("/run/vm-1")), ram_file=Path("/r"), incoming=False)
    assert argv[argv.index("-append") + 1].endswith("tsc_early_khz=1000")


def test_new_vms_have_no_pit_and_older_records_keep_theirs() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    machine = lambda cfg: build_argv(cfg, rt, ram_file=rt.ram, incoming=False)[4]  # noqa: E731
    assert machine(CFG).endswith(",pit=off")  # its ticking woke QEMU 40 times a second
    assert MachineConfig.from_json(CFG.to_json()) == CFG
    old = {k: v for k, v in CFG.to_json().items() if k != "pit"}  # a snapshot made before
    restored = MachineConfig.from_json(old)
    assert restored.pit and "pit=off" not in machine(restored)  # its vmstate has a PIT


def test_a_restore_does_not_load_the_kernel() -> None:
    rt = RuntimePaths(Path("/run/vm-1"))
    boot = build_argv(CFG, rt, ram_file=rt.ram, incoming=False)
    restore = build_argv(CFG, rt, ram_file=Path("/snap/memory.bin"), incoming=True)
    assert boot[boot.index("-kernel") + 1] == "/img/vmlinuz" and "-initrd" in boot
    assert not {"-kernel", "-initrd", "-append"} & set(restore)  # 17 MiB QEMU would hold
