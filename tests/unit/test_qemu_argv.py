from __future__ import annotations

from pathlib import Path

from forkd.vmm.qemu.argv import (
    MachineConfig,
    RuntimePaths,
    build_argv,
    host_tsc_khz,
    kernel_cmdline,
)
from forkd.vmm.volumes.disks import Attachment

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


# The whole command line, pinned for two machines far apart: any change to what
# QEMU is given must show up here (a restore must match its snapshot's devices).
_COMMON_HEAD = [
    "qemu-system-x86_64",
    "-name",
    "forkd-vm,1",
]
_COMMON_DEVICES = [
    "-device",
    "virtio-serial-device",
    "-chardev",
    "socket,id=agent,path=/run/vm,,1/agent.sock,server=on,wait=off",
    "-device",
    "virtserialport,chardev=agent,name=agent",
    "-object",
    "rng-random,id=rng,filename=/dev/urandom",
    "-device",
    "virtio-rng-device,rng=rng",
]


def test_full_argv_of_a_tcg_boot_with_a_runtime_disk_and_no_internet() -> None:
    rt = RuntimePaths(Path("/run/vm,1"))  # a comma QEMU must see doubled
    cfg = MachineConfig(
        memory_mib=512,
        vcpus=2,
        accel="tcg",
        vmlinuz=Path("/img/vmlinuz"),
        initrd=Path("/img/initrd.img"),
        rootfs=Path("/img/rootfs.sqfs"),
        internet=False,
        cmdline="console=ttyS0 x=1",
        runtime=Path("/img/runtime.sqfs"),
    )
    assert build_argv(cfg, rt, ram_file=rt.ram, incoming=False) == [
        *_COMMON_HEAD,
        "-machine",
        "microvm,memory-backend=mem,suppress-vmdesc=on,pit=off",
        "-m",
        "512M",
        "-smp",
        "2",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-object",
        "memory-backend-file,id=mem,size=512M,mem-path=/run/vm,,1/ram.bin,share=off",
        "-chardev",
        "file,id=console,path=/run/vm,,1/console.log",
        "-serial",
        "chardev:console",
        "-drive",
        "file=/img/rootfs.sqfs,format=raw,if=none,id=root,readonly=on",
        "-device",
        "virtio-blk-device,drive=root,serial=forkd-root",
        "-drive",
        "file=/img/runtime.sqfs,format=raw,if=none,id=runtime,readonly=on",
        "-device",
        "virtio-blk-device,drive=runtime,serial=forkd-runtime",
        *_COMMON_DEVICES,
        "-netdev",
        "user,id=net0,restrict=on",
        "-device",
        "virtio-net-device,netdev=net0",
        "-qmp",
        "unix:/run/vm,,1/qmp.sock,server=on,wait=off",
        "-kernel",
        "/img/vmlinuz",
        "-initrd",
        "/img/initrd.img",
        "-append",
        "console=ttyS0 x=1",
        "-accel",
        "tcg,tb-size=64",
        "-cpu",
        "max",
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]


def test_full_argv_of_a_kvm_restore_with_volumes_tap_and_runas() -> None:
    rt = RuntimePaths(Path("/run/vm,1"))
    cfg = MachineConfig(256, 1, "kvm", Path("/k"), Path("/i"), Path("/r"), pit=True)
    vols = [
        Attachment("ro", "/ro", True, ("/v/ro/base.img",)),
        Attachment("rw", "/rw", False, ("/v/rw/layers/a.qcow2", "/v/rw/base.img")),
    ]
    argv = build_argv(
        cfg,
        rt,
        ram_file=Path("/snap/memory.bin"),
        incoming=True,
        volumes=vols,
        tap=True,
        runas="70000:70000",
        layer_fds={1: (7, 8)},
        boot_files=True,
    )
    head = [
        *_COMMON_HEAD,
        "-machine",
        "microvm,memory-backend=mem,suppress-vmdesc=on",
        "-m",
        "256M",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-object",
        "memory-backend-file,id=mem,size=256M,mem-path=/snap/memory.bin,share=off",
        "-chardev",
        "ringbuf,id=console,size=1048576",
        "-serial",
        "chardev:console",
        "-drive",
        "file=/r,format=raw,if=none,id=root,readonly=on",
        "-device",
        "virtio-blk-device,drive=root,serial=forkd-root",
        *_COMMON_DEVICES,
    ]
    tail = [
        "-accel",
        "kvm",
        "-cpu",
        "host",
    ]
    incoming = [
        "-incoming",
        "defer",
        "-global",
        "migration.send-configuration=off",
        "-global",
        "migration.announce-rounds=0",
    ]
    assert argv == [
        *head,
        "-netdev",
        "tap,id=net0,ifname=tap0,script=no,downscript=no",
        "-device",
        "virtio-net-device,netdev=net0",
        "-qmp",
        "unix:/run/vm,,1/qmp.sock,server=on,wait=off",
        "-kernel",
        "/k",
        "-initrd",
        "/i",
        "-append",
        "console=ttyS0 panic=-1 reboot=t no_timer_check i8042.noaux i8042.nomux psi=0",
        "-drive",
        "file=/v/ro/base.img,format=raw,if=none,id=vol0,readonly=on",
        "-device",
        "virtio-blk-device,drive=vol0,serial=forkd-vol0",
        "-add-fd",
        "fd=7,set=2,opaque=ro",
        "-add-fd",
        "fd=8,set=2,opaque=rw",
        "-drive",
        "file=/dev/fdset/2,format=qcow2,if=none,id=vol1,readonly=off",
        "-device",
        "virtio-blk-device,drive=vol1,serial=forkd-vol1",
        *tail,
        "-sandbox",
        "on,obsolete=deny,spawn=deny,resourcecontrol=deny",
        "-runas",
        "70000:70000",
        *incoming,
    ]
    plain = build_argv(cfg, rt, ram_file=Path("/snap/memory.bin"), incoming=True, sandbox=False)
    assert plain == [
        *head,
        "-netdev",
        "user,id=net0",
        "-device",
        "virtio-net-device,netdev=net0",
        "-qmp",
        "unix:/run/vm,,1/qmp.sock,server=on,wait=off",
        *tail,
        *incoming,
    ]
