"""QEMU command lines. One device list serves boots and restores alike.

A restore must present exactly the devices the snapshot was taken with, so
both paths go through :func:`build_argv`; only the RAM file and
``-incoming`` differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.vmm.volumes.disks import Attachment
from forkd.vmm.volumes.shares import Share, fsdev_args

QEMU_BINARY = "qemu-system-x86_64"
# psi=0: pressure stall accounting would wake an idle guest every 2 s to average.
KERNEL_CMDLINE = "console=ttyS0 panic=-1 reboot=t no_timer_check i8042.noaux i8042.nomux psi=0"
TCG_TB_SIZE_MIB = 64  # bounded translation cache per VM
TCG_CMDLINE = "clearcpuid=erms tsc=reliable"  # see kernel_cmdline
CONSOLE_RING_BYTES = 1 << 20
RUNTIME_CMDLINE = "forkd.runtime=1"  # stage 1 waits for the runtime disk and mounts it
FD_READ_ONLY, FD_READ_WRITE = "ro", "rw"  # the tags of descriptors in QEMU's fd sets
AGENT_CHARDEV = "agent"  # the socket chardev behind the agent's virtio-serial port
TCG_CPU = "max"  # every feature TCG emulates (x86-64-v3 level on QEMU 7.2)
# QEMU's seccomp filter: no obsolete system calls, no setuid/setgid, no
# fork/exec, no scheduler or affinity changes. Nothing forkd asks of QEMU
# needs them (boot, fd migration, device-state saves, volume overlays).
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# With -runas, QEMU itself calls setgid/setuid to drop to its uid, after it
# installed the filter, so elevateprivileges=deny would kill it ("Bad system
# call" in QEMU 7.2). Once dropped it has no privilege to raise again: its
# real, effective and saved ids are all that uid, it holds no capability and
# its bounding set is empty (forkd.vmm.qemu.launch.RUNAS_CAPS), no_new_privs is
# set, and spawn=deny stops it running any program.
SANDBOX_RUNAS = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"


def layer_fdset(index: int) -> int:
    """The fd set holding volume ``index``'s writable top layer.

    QEMU opens that layer again, read-write, when a restored VM first runs
    (its drives start inactive under ``-incoming``); by then it may have
    dropped to its user, which cannot open forkd's files by name. From an fd
    set it takes a copy of a descriptor the daemon opened instead. The
    layers below are only read and are never opened again.

    The read-write descriptor must leave the set once QEMU holds its copy
    (:meth:`forkd.vmm.qemu.qmp.QMPChannel.release_writers`): QEMU's image
    locks belong to the open file, which the set's descriptor shares, so
    while it stays the layer stays write-locked even after a snapshot froze
    it, and no fork could open it.
    """
    return index + 1


def _opt(path: Path) -> str:
    """A path inside a QEMU option string: commas are doubled, as QEMU expects."""
    return str(path).replace(",", ",,")


@dataclass(frozen=True)
class MachineConfig:
    memory_mib: int
    vcpus: int
    accel: str  # "kvm" | "tcg"
    vmlinuz: Path
    initrd: Path
    rootfs: Path
    internet: bool = True
    cmdline: str = KERNEL_CMDLINE
    # The egress policy's JSON form (forkd.vmm.jail.egress); None: from ``internet``.
    egress: str | dict[str, Any] | None = None
    # The legacy i8254 timer. The guest never uses it (it has the LAPIC timer and
    # is told the TSC rate), yet QEMU's PIT keeps ticking on after boot and wakes
    # QEMU's main loop ~40 times a second: 85 % of an idle VM's wakeups. Off for
    # new VMs; snapshots and VMs recorded without the key had it (and keep it:
    # their device state includes it).
    pit: bool = False
    # An imported container image's second disk (forkd's agent and its Python,
    # mounted at /opt/forkd): the kernel is told with RUNTIME_CMDLINE.
    runtime: Path | None = None
    # How many 9p share slots it has (forkd.vmm.volumes.shares): SHARE_SLOTS for a
    # machine made now; none for one recorded without the key (its devices lack them).
    shares: int = 0

    def files(self) -> tuple[Path, ...]:
        """The host files the machine boots from and reads while it runs."""
        disks = (self.rootfs,) if self.runtime is None else (self.rootfs, self.runtime)
        return (self.vmlinuz, self.initrd, *disks)

    def to_json(self) -> dict[str, Any]:
        data = {
            "memory_mib": self.memory_mib,
            "vcpus": self.vcpus,
            "accel": self.accel,
            "vmlinuz": str(self.vmlinuz),
            "initrd": str(self.initrd),
            "rootfs": str(self.rootfs),
            "internet": self.internet,
            "cmdline": self.cmdline,
            "pit": self.pit,
        }
        if self.egress is not None:
            data["egress"] = self.egress
        if self.runtime is not None:
            data["runtime"] = str(self.runtime)
        if self.shares:
            data["shares"] = self.shares
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineConfig:
        return cls(
            memory_mib=int(data["memory_mib"]),
            vcpus=int(data["vcpus"]),
            accel=str(data["accel"]),
            vmlinuz=Path(data["vmlinuz"]),
            initrd=Path(data["initrd"]),
            rootfs=Path(data["rootfs"]),
            internet=bool(data.get("internet", True)),
            cmdline=str(data.get("cmdline", KERNEL_CMDLINE)),
            egress=data.get("egress"),
            pit=bool(data.get("pit", True)),
            runtime=Path(data["runtime"]) if data.get("runtime") else None,
            shares=int(data.get("shares", 0)),
        )


NETDEV_ID = "net0"  # QMP names it: forkd.vmm.agent.ports adds host forwards to it


def _netdev(cfg: MachineConfig, tap: bool) -> str:
    if tap:
        return f"tap,id={NETDEV_ID},ifname=tap0,script=no,downscript=no"
    return f"user,id={NETDEV_ID}" + ("" if cfg.internet else ",restrict=on")


def host_tsc_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The host's TSC rate in kHz, as /proc/cpuinfo reports it ("cpu MHz")."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("cpu MHz"):
                return round(float(line.partition(":")[2]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def kernel_cmdline(accel: str, tsc_khz: int | None = None, *, runtime: bool = False) -> str:
    """The guest kernel command line for a VM booted under ``accel``.

    Under TCG the guest's TSC ticks at the host's TSC rate, and microvm offers
    no HPET or ACPI PM timer to calibrate it against; PIT calibration fails
    when the host is busy and the guest then hangs early in boot. Telling the
    kernel the rate (``tsc_early_khz``) skips the calibration altogether.

    The CPU model advertises ERMS, so the kernel would copy to and from user
    memory with ``rep movsb``, which TCG runs a byte at a time: every pipe,
    socket and virtio-serial copy cost 6-8 ms a MiB. ``clearcpuid=erms`` makes
    it use its word-sized copies instead (a process's output through the agent
    goes from ~55 to ~28 ms of guest CPU a MiB). ``tsc=reliable``: that TSC is
    the host's, so the kernel need not check it against the jiffies twice a
    second (the clocksource watchdog was a fifth of an idle guest's wakeups).
    Only new boots take it: a
    snapshot keeps the kernel state it was taken with. ``runtime``: the machine
    has a runtime disk (an imported container image's).
    """
    base = f"{KERNEL_CMDLINE} {RUNTIME_CMDLINE}" if runtime else KERNEL_CMDLINE
    if accel != "tcg":
        return base
    khz = tsc_khz if tsc_khz is not None else host_tsc_khz()
    cmdline = f"{base} {TCG_CMDLINE}"
    return f"{cmdline} tsc_early_khz={khz}" if khz else cmdline


@dataclass(frozen=True)
class RuntimePaths:
    """Per-VM files on the host."""

    dir: Path

    @property
    def qmp(self) -> Path:
        return self.dir / "qmp.sock"

    @property
    def agent(self) -> Path:
        return self.dir / "agent.sock"

    @property
    def console(self) -> Path:
        return self.dir / "console.log"

    @property
    def qemu_log(self) -> Path:
        return self.dir / "qemu.log"

    @property
    def ram(self) -> Path:
        """RAM file of a freshly booted VM (a restored VM maps its snapshot's)."""
        return self.dir / "ram.bin"

    @property
    def meta(self) -> Path:
        return self.dir / "vm.json"

    @property
    def empty_share(self) -> Path:
        """The empty directory a share slot with no share serves (read-only)."""
        return self.dir / "empty-share"


# announce-rounds=0: no self-announcement once the state is loaded. After a
# migration QEMU sends RARPs and has a virtio NIC make its guest send
# gratuitous ARPs and IPv6 neighbour adverts, so switches learn the VM moved.
# A fork's link is new and point to point: nobody needs them, and under TCG
# they cost each fork about 1,200 freshly translated blocks.
_INCOMING_ARGS = (
    "-incoming",
    "defer",
    "-global",
    "migration.send-configuration=off",
    "-global",
    "migration.announce-rounds=0",
)


def build_argv(
    cfg: MachineConfig,
    rt: RuntimePaths,
    *,
    ram_file: Path,
    incoming: bool,
    volumes: Sequence[Attachment] = (),
    tap: bool = False,
    sandbox: bool = True,
    runas: str | None = None,
    layer_fds: Mapping[int, tuple[int, int]] | None = None,
    boot_files: bool | None = None,
    shares: Sequence[Share] = (),
) -> list[str]:
    """QEMU's command line. ``tap``: the VM's network is ``tap0`` of the network
    namespace QEMU starts in (forkd.vmm.jail.network); else user-mode NAT. ``runas``:
    the ``UID:GID`` QEMU drops to once it has opened its files (forkd.vmm.jail.qemu_user).
    ``layer_fds``: volume index → the read-only and read-write descriptors of
    its writable top layer, which QEMU inherits (see :func:`layer_fdset`).
    ``boot_files``: pass the kernel and initrd (default: only when booting; a
    full migration stream, whose ROMs must match, needs them on restore too).
    ``shares``: the directories served in the machine's share slots."""
    argv = _machine_args(cfg, rt, ram_file=ram_file, incoming=incoming, tap=tap)
    if boot_files if boot_files is not None else not incoming:
        # QEMU holds the kernel (14 MiB) and initrd in its own memory for as long
        # as it runs. A restored guest has its kernel in RAM already and never
        # reads them; its device state loads without them.
        argv += ["-kernel", str(cfg.vmlinuz), "-initrd", str(cfg.initrd), "-append", cfg.cmdline]
    argv += _volume_args(volumes, layer_fds)
    argv += fsdev_args(cfg.shares, shares, rt.empty_share)
    argv += _accel_args(cfg.accel)
    if sandbox:  # False only where this QEMU lacks seccomp (launch.seccomp_problem)
        argv += ["-sandbox", SANDBOX_RUNAS if runas else SANDBOX]
    if runas:
        argv += ["-runas", runas]
    if incoming:
        argv += _INCOMING_ARGS
    return argv


def _machine_args(
    cfg: MachineConfig, rt: RuntimePaths, *, ram_file: Path, incoming: bool, tap: bool
) -> list[str]:
    """The machine and its fixed devices: identical for a boot and a restore but
    for the RAM file and the console's backend (neither is in the saved state)."""
    return [
        *_machine(cfg, rt, ram_file),
        *_console(rt, incoming),
        *_disks(cfg),
        "-device",
        "virtio-serial-device",
        "-chardev",
        f"socket,id={AGENT_CHARDEV},path={_opt(rt.agent)},server=on,wait=off",
        "-device",
        f"virtserialport,chardev={AGENT_CHARDEV},name=agent",
        "-object",
        "rng-random,id=rng,filename=/dev/urandom",
        "-device",
        "virtio-rng-device,rng=rng",
        "-netdev",
        _netdev(cfg, tap),
        "-device",
        f"virtio-net-device,netdev={NETDEV_ID}",
        "-qmp",
        f"unix:{_opt(rt.qmp)},server=on,wait=off",
    ]


def _machine(cfg: MachineConfig, rt: RuntimePaths, ram_file: Path) -> list[str]:
    """QEMU, the microvm machine, its vCPUs and its RAM (``ram_file``), nothing else."""
    mem = f"{cfg.memory_mib}M"
    return [
        QEMU_BINARY,
        "-name",
        f"forkd-{rt.dir.name}",
        "-machine",
        f"microvm,memory-backend=mem,suppress-vmdesc=on{'' if cfg.pit else ',pit=off'}",
        "-m",
        mem,
        "-smp",
        str(cfg.vcpus),
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        # RAM is a private mapping of a file: a restored VM shares every page
        # of its snapshot it has not written, and never writes the file.
        "-object",
        # (Not readonly=on: in QEMU 7.2 that maps the RAM read-only as well.)
        f"memory-backend-file,id=mem,size={mem},mem-path={_opt(ram_file)},share=off",
    ]


def _console(rt: RuntimePaths, incoming: bool) -> list[str]:
    """The serial console: a booted VM's goes to a file (boot diagnostics); a fork's to a
    1 MiB ring (read with QMP ringbuf-read), so no guest can fill the host's disk through
    its serial port. The backend is not part of the saved state, so both fit one
    snapshot."""
    return [
        "-chardev",
        (
            f"ringbuf,id=console,size={CONSOLE_RING_BYTES}"
            if incoming
            else f"file,id=console,path={_opt(rt.console)}"
        ),
        "-serial",
        "chardev:console",
    ]


def _disks(cfg: MachineConfig) -> list[str]:
    """The root disk, and the runtime disk when the image has one: read-only both."""
    return [
        "-drive",
        f"file={_opt(cfg.rootfs)},format=raw,if=none,id=root,readonly=on",
        "-device",
        "virtio-blk-device,drive=root,serial=forkd-root",
        *(
            ()
            if cfg.runtime is None
            else (
                "-drive",
                f"file={_opt(cfg.runtime)},format=raw,if=none,id=runtime,readonly=on",
                "-device",
                "virtio-blk-device,drive=runtime,serial=forkd-runtime",
            )
        ),
    ]


def _volume_args(
    volumes: Sequence[Attachment], layer_fds: Mapping[int, tuple[int, int]] | None
) -> list[str]:
    """One drive and one disk per volume; a top layer with descriptors is read from its fd set."""
    argv: list[str] = []
    for i, vol in enumerate(volumes):
        # The guest finds each volume by its serial (forkd-vol<i>), not by name.
        ro = "on" if vol.readonly else "off"
        top = _opt(vol.top)
        if layer_fds and i in layer_fds:
            fdset = layer_fdset(i)
            ro_fd, rw_fd = layer_fds[i]
            argv += [
                "-add-fd",
                f"fd={ro_fd},set={fdset},opaque={FD_READ_ONLY}",
                "-add-fd",
                f"fd={rw_fd},set={fdset},opaque={FD_READ_WRITE}",
            ]
            top = f"/dev/fdset/{fdset}"
        argv += [
            "-drive",
            f"file={top},format={vol.format},if=none,id=vol{i},readonly={ro}",
            "-device",
            f"virtio-blk-device,drive=vol{i},serial=forkd-vol{i}",
        ]
    return argv


def _accel_args(accel: str) -> list[str]:
    if accel == "kvm":
        return ["-accel", "kvm", "-cpu", "host"]
    # QEMU's default qemu64 model lacks SSSE3/SSE4.2, which current wheels
    # (numpy 2 and friends) require: they die with SIGILL at import.
    return ["-accel", f"tcg,tb-size={TCG_TB_SIZE_MIB}", "-cpu", TCG_CPU]
