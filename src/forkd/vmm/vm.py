"""One QEMU microVM: boot, restore (fork), pause, snapshot, resume, kill.

Every VM's RAM is a private mapping of a file. A booted VM maps a new sparse
file; a restored VM maps its snapshot's ``memory.bin`` read-only, so the host
kernel shares each page among all children until one writes it.

Snapshotting any running VM (template or child, at any depth) is::

    writer = await vm.begin_snapshot(dest)   # stage, clone the base (VM runs)
    await vm.pause()
    await writer.capture()                   # vmstate + written pages
    await vm.resume()
    await writer.commit(labels)              # snapshot.json, rename into place

:func:`forkd.vmm.snapshot.live.snapshot_running` runs that sequence with the
failure table, for :meth:`VM.snapshot` and the daemon's branches alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Unpack

from forkd import limits
from forkd.errors import SnapshotError, VMError
from forkd.states import VMState
from forkd.vmm import runtime_meta, vm_start, warm_start
from forkd.vmm.agent.client import AgentClient
from forkd.vmm.agent.ops import Guest
from forkd.vmm.agent.ports import HostForwards
from forkd.vmm.jail import cgroups, egress, network, qemu_user
from forkd.vmm.qemu import host_processes, launch
from forkd.vmm.qemu.argv import AGENT_CHARDEV, MachineConfig, RuntimePaths
from forkd.vmm.qemu.host_processes import qemu_pid_matches
from forkd.vmm.qemu.launch import tail
from forkd.vmm.qemu.qmp import CONNECT_TIMEOUT_SECS, QMPChannel
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import live as live_snapshot
from forkd.vmm.snapshot import memory, memory_diff
from forkd.vmm.snapshot.files import BaseRef, ImageRef, SnapshotFiles, SnapshotLabels
from forkd.vmm.snapshot.write_tracking import WriteTracker
from forkd.vmm.snapshot.writer import SnapshotWriter
from forkd.vmm.vcpu_control import Vcpus
from forkd.vmm.vm_state import VMLifecycle
from forkd.vmm.volumes import mounts as volume_mounts
from forkd.vmm.volumes.disks import Attachment
from forkd.vmm.volumes.shares import Share

__all__ = ["VM", "SnapshotWriter", "qemu_pid_matches"]

if TYPE_CHECKING:  # only its type: the guest images sit above the VM
    from forkd.guest.image import Image

log = logging.getLogger(__name__)

BOOT_MEMORY_MIB = 256  # VM.boot's default; the daemon passes its own
ADOPT_TIMEOUT_SECS = 10.0


class VM(VMLifecycle):
    """A running (or paused, or dead) QEMU process: its state (:class:`VMLifecycle`)
    and the parts it holds, its guest through the agent's connection (:class:`Guest`),
    its vCPUs (:class:`Vcpus`) and the host's way to its ports (:class:`HostForwards`);
    a pooled VM is warmed by :mod:`forkd.vmm.warm_start`."""

    def __init__(
        self,
        vm_id: str,
        rt: RuntimePaths,
        machine: MachineConfig,
        ram_file: Path,
        image: ImageRef | None,
        origin: Path | None,
        proc: subprocess.Popen[bytes] | None,
        pid: int,
    ) -> None:
        self.id = vm_id
        self.rt = rt
        self.machine = machine
        self.ram_file = ram_file
        # Its inode finds the mapping even after the snapshot is renamed or deleted.
        self.ram_inode = memory.inode_of(ram_file)
        self.image = image
        self.origin = origin  # snapshot directory this VM was forked from
        self.origin_id: str | None = None  # and that snapshot's id (snapshot.json)
        self._proc = proc
        self.pid = pid
        self.qmp = QMPChannel(vm_id, rt.qmp)
        self.agent = AgentClient(rt.agent)
        self.guest = Guest(vm_id, self.agent, self.console_tail, self._raise_if_dead)
        self.vcpus = Vcpus(vm_id, self.agent, self.qmp, self._set_state, self._raise_if_dead)
        self.forwards = HostForwards(vm_id, self.qmp)
        self.started_at = time.time()
        self.ready_ms: float | None = None  # process start -> agent answered
        self._incoming: SnapshotFiles | None = None
        self.volumes: list[Attachment] = []  # in device order: serial forkd-vol<i>
        self.net: network.SandboxNet | None = None  # its namespace, if it has one
        self.cgroup: cgroups.Group | None = None  # its caps, if the host has cgroups
        self.uid: qemu_user.Lease | None = None  # the uid QEMU dropped to, if it did
        self.write_tracker: WriteTracker | None = None  # made by its first live snapshot

    # ---------------------------------------------------------------- start

    @classmethod
    async def boot(
        cls,
        image: Image,
        *,
        run_root: Path,
        memory_mib: int = BOOT_MEMORY_MIB,
        vcpus: int = limits.DEFAULT_VCPUS,
        accel_name: str | None = None,
        vm_id: str | None = None,
        boot_timeout: float = limits.BOOT_TIMEOUT_SECS,
        internet: bool = True,
        detach: bool = False,
        attach: Sequence[Attachment] = (),
        host_network: network.HostNetwork | None = None,
        egress_policy: egress.Egress | None = None,
        cgroup: cgroups.Placement | None = None,
    ) -> VM:
        """Cold-boot a VM from ``image``; returns once its agent answers.

        ``attach``: volumes (see :mod:`forkd.vmm.volumes.disks`), mounted in the
        guest before this returns. ``host_network``: gives the VM a network
        namespace of its own with ``egress_policy`` (default: from ``internet``).
        ``cgroup``: QEMU runs in a cgroup of its own there, with caps.
        """
        policy = egress_policy or egress.Egress.from_internet(internet)
        machine = vm_start.boot_machine(image, memory_mib, vcpus, accel_name, policy)
        vm_id = vm_id or vm_start.new_vm_id()
        async with contextlib.AsyncExitStack() as undo:  # unwound unless the boot succeeds
            rt = vm_start.run_dir(run_root, vm_id, undo)
            with rt.ram.open("wb") as f:  # sparse: costs nothing until written
                f.truncate(memory_mib << 20)
            started = time.monotonic()
            spec = launch.LaunchSpec(
                machine=machine,
                rt=rt,
                ram_file=rt.ram,
                incoming=False,
                policy=policy,
                attach=attach,
                detach=detach,
                host_network=host_network,
                placement=cgroup,
            )
            launched = await launch.start_qemu(spec, undo)
            image_ref = ImageRef(image.name, image.key, str(image.dir))
            vm = cls(vm_id, rt, machine, rt.ram, image_ref, None, launched.proc, launched.proc.pid)
            vm._own(launched, list(attach))
            undo.pop_all()  # from here undoing the start is killing the VM: it owns them all
            undo.push_async_callback(vm.kill)
            await vm._connect_qmp()
            await vm.agent.connect()
            await vm.guest.wait_ready(boot_timeout)
            await volume_mounts.mount_all(vm.guest.exec, vm.volumes)
            undo.pop_all()
        vm.ready_ms = (time.monotonic() - started) * 1000
        vm._set_state(VMState.RUNNING)
        runtime_meta.write_for(vm)
        return vm

    @classmethod
    async def restore(
        cls,
        snapshot_dir: Path,
        *,
        hostname: str | None = None,
        timeout: float = limits.RESTORE_TIMEOUT_SECS,
        seed: int | None = None,
        **spawn: Unpack[vm_start.SpawnOptions],
    ) -> VM:
        """Fork a new VM from a snapshot directory; returns once its agent answered.

        ``spawn``: the keywords of :meth:`spawn_incoming` (``run_root`` first). After
        the restore the guest is told the wall-clock time, given fresh entropy (kernel
        RNG and the warm interpreter's ``random``) and a new hostname, so no two
        children share random numbers (``seed``: Python's random is seeded from it
        instead, and so is every Python process the guest starts).
        """
        started = time.monotonic()
        vm = await cls.spawn_incoming(snapshot_dir, **spawn)
        await vm.finish_restore(hostname=hostname, timeout=timeout, started=started, seed=seed)
        return vm

    @classmethod
    async def spawn_incoming(
        cls,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = None,
        detach: bool = False,
        internet: bool | None = None,
        host_network: network.HostNetwork | None = None,
        egress_policy: egress.Egress | None = None,
        cgroup: cgroups.Placement | None = None,
        shares: Sequence[Share] = (),
    ) -> VM:
        """Start QEMU for a fork of ``snapshot_dir`` and leave it waiting for its state.

        The first half of :meth:`restore`; :meth:`finish_restore` is the second. Starting
        QEMU is a good part of a fork's latency, so :class:`forkd.vmm.pool.ForkPool` keeps
        a few of these ready. The egress policy is ``egress_policy``, else ``internet``,
        else the snapshot's; ``shares``: the directories its share slots serve.
        """
        snap = snapshot_files.load(snapshot_dir)
        policy, machine = vm_start.fork_machine(snap, internet, egress_policy, shares)
        vm_id = vm_id or vm_start.new_vm_id()
        async with contextlib.AsyncExitStack() as undo:  # unwound unless the start succeeds
            rt = vm_start.run_dir(run_root, vm_id, undo)
            attach = vm_start.fork_volumes(snap, undo)
            # A diff maps its chain's full root; its layers are written in below.
            chain = memory_diff.resolve(snap)
            with contextlib.closing(chain):
                spec = launch.LaunchSpec(
                    machine=machine,
                    rt=rt,
                    ram_file=chain.root,
                    incoming=True,
                    policy=policy,
                    attach=attach,
                    shares=shares,
                    detach=detach,
                    host_network=host_network,
                    placement=cgroup,
                )
                launched = await launch.start_qemu(spec, undo)
                proc = launched.proc
                vm = cls(vm_id, rt, machine, chain.root, snap.meta.image, snap.dir, proc, proc.pid)
                vm._own(launched, attach)
                undo.pop_all()  # from here undoing the start is killing the VM
                undo.push_async_callback(vm.kill)
                vm.origin_id = snap.meta.id
                vm._set_state(VMState.INCOMING)
                vm._incoming = snap
                await vm._connect_qmp()  # QEMU has mapped guest RAM by now
                await asyncio.to_thread(memory_diff.apply, chain, vm.pid)
                # Connected before the state is loaded: see finish_restore.
                await vm.agent.connect()
            undo.pop_all()
        return vm

    def _own(self, launched: launch.Launched, attach: list[Attachment]) -> None:
        """Take over what the start made: :meth:`kill` lets go of every one of them."""
        self.net, self.cgroup, self.uid = launched.net, launched.cgroup, launched.uid
        self.volumes = attach

    async def finish_restore(
        self,
        *,
        hostname: str | None = None,
        timeout: float = limits.RESTORE_TIMEOUT_SECS,
        started: float | None = None,
        seed: int | None = None,
    ) -> None:
        """Load the snapshot's state into a VM from :meth:`spawn_incoming` and run it
        (``seed``: see :meth:`restore`).

        ``ready_ms`` counts from ``started`` (default: now) to the agent's answer.

        QEMU must have *accepted* the agent connection before ``cont``. The
        snapshot says a host was connected to the agent's port; at ``cont``
        QEMU compares that with whether one is connected now and, if not,
        tells the guest the host went away. The guest agent then reads EOF and
        closes the port, and the kernel drops whatever arrived in between:
        the ``restore`` request, when QEMU accepted the connection a moment
        later. The fork then hung until its timeout with the guest idle
        (docs/RUNBOOK.md, "A fork times out with 'agent did not answer'").
        """
        snap = self._incoming
        if snap is None or self.state != VMState.INCOMING:
            raise VMError(f"{self.id} is not waiting for a snapshot's state")
        started = time.monotonic() if started is None else started
        try:
            self._raise_if_dead("QEMU waiting for the snapshot's state exited")
            await self.qmp.load_vmstate(snap.vmstate, timeout, self.rt.qemu_log)
            await self.qmp.wait_accepted(AGENT_CHARDEV, timeout)
            await self.qmp.execute("cont")
            self._set_state(VMState.RUNNING)
            await self.guest.reseed(hostname or self.id, timeout, snap.dir, snap.memory, seed)
        except VMError as exc:
            # QEMU gone mid-restore: name the files a damaged snapshot could be.
            dead = await self.gone()
            said = tail(self.rt.qemu_log, 500) or "nothing"
            await self.kill()
            if dead:
                raise SnapshotError(
                    f"QEMU exited while restoring from {snap.dir}: {snap.memory} or "
                    f"{snap.vmstate} may be corrupt ({exc}; QEMU said: {said})"
                ) from exc
            raise
        except BaseException:
            await self.kill()
            raise
        self._incoming = None
        self.ready_ms = (time.monotonic() - started) * 1000
        runtime_meta.write_for(self)

    @classmethod
    async def adopt(
        cls, run_dir: Path, paused: bool = False, timeout: float = ADOPT_TIMEOUT_SECS
    ) -> VM:
        """Take over a VM an earlier process started (detached) in ``run_dir``, left
        running or ``paused``; :class:`VMError` when its QEMU is gone, is not the one
        the metadata names, or its agent does not answer (not asked when paused)."""
        rt, rec = vm_start.left_running(run_dir)
        vm = cls(
            rec.id, rt, rec.machine, rec.ram_file, rec.image, rec.origin_snapshot, None, rec.pid
        )
        vm.started_at, vm.origin_id = rec.started_at_unix, rec.origin_id
        vm.volumes = list(rec.volumes)
        vm.net = rec.network
        vm.cgroup = rec.cgroup  # QEMU stays in its group; kill() removes it
        vm.uid = qemu_user.adopt(rec.pid, host_processes.owner_uid(rec.pid))  # and keeps its uid
        await vm._connect_qmp(timeout)
        await vm.qmp.set_running(not paused)  # a daemon died mid-branch or mid-resume
        await vm.agent.connect(timeout)
        if not paused:
            await vm.guest.wait_ready(timeout)
        vm._set_state(VMState.PAUSED if paused else VMState.RUNNING)
        return vm

    async def _connect_qmp(self, timeout: float = CONNECT_TIMEOUT_SECS) -> None:
        await self.qmp.connect(self._raise_if_dead, timeout)

    # ------------------------------------------------------------ lifecycle

    def is_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        # Not our child (re-adopted): the pid alone could have been reused.
        return qemu_pid_matches(self.pid, self.rt.dir)

    async def freeze_volumes(self, prepared: Sequence[volume_mounts.NextLayer]) -> list[Attachment]:
        """At a pause: freeze each writable volume's layer for a snapshot (VM paused).

        Returns the attachments as the snapshot records them; the VM goes on
        writing the ``prepared`` layers above them (see
        :func:`volume_mounts.freeze_layers`).
        """
        try:
            return await volume_mounts.freeze_layers(self.qmp, self.volumes, prepared)
        finally:
            # Also after a failure half-way: the record must name every layer
            # QEMU writes, or a restarted daemon would collect one in use.
            if self.volumes:
                runtime_meta.write_for(self)

    async def console_tail(self, limit: int = 800) -> str:
        """The end of the guest's console: its file, or its ring buffer for a fork."""
        if self.rt.console.exists():
            return tail(self.rt.console, limit)
        return await self.qmp.console_ring(limit)

    async def gone(self, wait: float = 1.0) -> bool:
        """Whether QEMU has exited, allowing ``wait`` seconds for one that is exiting.

        After QMP's connection drops, the process may still be tearing down.
        """
        deadline = time.monotonic() + wait
        while self.is_alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        self._set_state(VMState.DEAD)
        return True

    # ------------------------------------------------------------ its parts

    async def pause(self) -> None:
        """Freeze the vCPUs (:meth:`Vcpus.pause`)."""
        await self.vcpus.pause()

    async def resume(self) -> None:
        await self.vcpus.resume()

    async def guest_port_address(self, port: int) -> tuple[str, int]:
        """The host and port the daemon connects to for guest TCP port ``port``."""
        return await self.forwards.address(port, self.net)

    async def prewarm(self, timeout: float = limits.RESTORE_TIMEOUT_SECS) -> None:
        """Restored ahead for the pool, then stopped (:func:`warm_start.prewarm`)."""
        await warm_start.prewarm(self, timeout)

    async def claim(
        self, timeout: float = limits.RESTORE_TIMEOUT_SECS, *, seed: int | None = None
    ) -> None:
        """A warm VM handed out (:func:`warm_start.claim`)."""
        await warm_start.claim(self, timeout, seed=seed)

    def _raise_if_dead(self, what: str) -> None:
        if not self.is_alive():
            self._set_state(VMState.DEAD)
            code = self._proc.returncode if self._proc else "?"
            qemu = tail(self.rt.qemu_log) or "(nothing)"
            console = tail(self.rt.console, 800) or "(nothing)"
            raise VMError(
                f"{what} (exit status {code}). QEMU said: {qemu} Guest console: {console}"
            )

    async def release(self) -> None:
        """Let go of the VM and leave it running, for the next daemon to adopt.

        Bounded: the agent channel is aborted, not flushed (a guest that
        stopped reading cannot hold this up), and QMP gets a few seconds.
        """
        await self.agent.close()
        if self.write_tracker is not None:  # its protection ends with the descriptor
            self.write_tracker.close()
            self.write_tracker = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.qmp.disconnect(), limits.AGENT_CLOSE_SECS)

    def set_egress(self, policy: egress.Egress) -> None:
        """Record a new egress policy in the VM's machine (a branch, a hibernation and a
        restarted daemon take it from there) and in its vm.json."""
        self.machine = dataclasses.replace(
            self.machine, egress=policy.to_json(), internet=not policy.shut
        )
        runtime_meta.write_for(self)

    async def kill(self) -> None:
        """Stop the VM for good: QEMU first, then its channels, then its files.

        QEMU goes first so that nothing the guest does can delay it: once the
        process is gone its sockets are closed and nothing is left to flush.
        """
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
        elif qemu_pid_matches(self.pid, self.rt.dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if not await self.gone(limits.KILL_WAIT_SECS):  # polls: no thread waits on it
            log.error("QEMU of %s (pid %s) still runs after SIGKILL", self.id, self.pid)
        self._set_state(VMState.DEAD)
        # Each step runs even when one before it failed (the last error is raised).
        async with contextlib.AsyncExitStack() as steps:  # run last pushed first
            steps.callback(shutil.rmtree, self.rt.dir, ignore_errors=True)
            steps.push_async_callback(self._remove_cgroup)
            steps.push_async_callback(self._detach_network)
            steps.callback(volume_mounts.remove_own_layers, self.volumes)
            if self.uid is not None:  # free for another VM (unless QEMU outlived SIGKILL)
                steps.push_async_callback(asyncio.to_thread, self.uid.release)
            steps.push_async_callback(self.release)

    async def _detach_network(self) -> None:
        await network.detach(self.net)  # QEMU is gone: its namespace can go
        self.net = None

    async def _remove_cgroup(self) -> None:
        if not await asyncio.to_thread(cgroups.remove, self.cgroup):
            log.warning("cgroup of %s is still in use: left in place", self.id)
        self.cgroup = None

    # ------------------------------------------------------------- snapshot

    async def begin_snapshot(
        self, dest: Path, base: BaseRef | None = None, *, live: bool = False
    ) -> SnapshotWriter:
        """Stage a snapshot of this VM at ``dest`` (which must not exist); with ``base``,
        a diff over that snapshot (the one this VM was forked from); ``live``: copy
        the guest's pages before the pause too (:mod:`forkd.vmm.snapshot.live_copy`)."""
        if dest.exists():
            raise SnapshotError(f"{dest} already exists")
        writer = SnapshotWriter(self, dest, base, live=live)
        await writer.prepare()
        return writer

    async def snapshot(self, dest: Path, labels: SnapshotLabels | None = None) -> Path:
        """Pause, snapshot to ``dest`` the live way (templates), resume
        (:func:`live_snapshot.write`); returns ``dest``."""
        return (await live_snapshot.write(self, dest, labels, live=True)).dir

    # --------------------------------------------------------------- memory

    def memory_usage(self) -> dict[str, int]:
        """Host memory of the QEMU process in bytes; ``private`` is what it alone costs."""
        return host_processes.memory_usage(self.pid)

    def cpu_times(self) -> tuple[float, float]:
        """(CPU seconds the QEMU process has used, its guest's vCPUs included; seconds
        since it started)."""
        return host_processes.cpu_times(self.pid)

    def resident_memory(self) -> dict[str, int]:
        """What the QEMU process holds now, cheaply read (``anon``: its own pages), in bytes."""
        return host_processes.resident_memory(self.pid)
