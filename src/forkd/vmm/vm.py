"""One QEMU microVM: boot, restore (fork), pause, snapshot, resume, kill.

Every VM's RAM is a private mapping of a file. A booted VM maps a new sparse
file; a restored VM maps its snapshot's ``memory.bin`` read-only, so the host
kernel shares each page among all children until one writes it.

Snapshotting any running VM (template or child, at any depth) is::

    writer = await vm.begin_snapshot(dest)   # stage, clone the base (VM runs)
    await vm.pause()
    await writer.capture()                   # vmstate + written pages
    await vm.resume()
    await writer.commit()                    # snapshot.json, rename into place

:meth:`VM.snapshot` runs that sequence with the failure handling; the
daemon's branch handler drives the steps itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient, QMPError

from forkd import __version__, accel, hosttools
from forkd.errors import AgentError, SnapshotError, VMError
from forkd.guest.image import Image
from forkd.vmm import live_snapshot, memory, snapshot_files, volumes
from forkd.vmm.agent_client import AgentClient
from forkd.vmm.qemu_argv import (
    QEMU_BINARY,
    MachineConfig,
    RuntimePaths,
    build_argv,
    kernel_cmdline,
)
from forkd.vmm.volumes import Attachment

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107
QMP_TIMEOUT_S = 30.0
MIN_MEMORY_MIB = 128  # the Debian kernel + Python guest does not boot in less
DEFERRED_WRITE_LIMIT = 1 << 30  # guest RAM held in memory between pause and commit
PR_SET_PDEATHSIG = 1


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now, not in a forked child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def qemu_pid_matches(pid: int, run_dir: Path) -> bool:
    """True when ``pid`` is alive and is the QEMU whose sockets live in ``run_dir``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    needle = str(run_dir / "qmp.sock").encode()
    return any(needle in arg for arg in cmdline)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_layers(attached: Sequence[Attachment]) -> None:
    for att in attached:
        layer = volumes.own_layer(att)
        if layer is not None:
            layer.unlink(missing_ok=True)


MOUNT_SCRIPT = (
    'for d in /sys/block/vd*; do if [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ]; then '
    'mkdir -p "$2" && exec mount -t ext4 -o "$3" "/dev/${d##*/}" "$2"; fi; done; '
    'echo "no disk with serial $1" >&2; exit 1'
)


def new_vm_id() -> str:
    return f"vm-{secrets.token_hex(4)}"


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


class VM:
    """A running (or paused, or dead) QEMU process and its agent connection."""

    def __init__(
        self,
        vm_id: str,
        rt: RuntimePaths,
        machine: MachineConfig,
        ram_file: Path,
        image: dict[str, Any],
        origin: Path | None,
        proc: subprocess.Popen[bytes] | None,
        pid: int,
    ) -> None:
        self.id = vm_id
        self.rt = rt
        self.machine = machine
        self.ram_file = ram_file
        self.image = image
        self.origin = origin  # snapshot directory this VM was forked from
        self._proc = proc
        self.pid = pid
        self.qmp = QMPClient(vm_id)
        self.agent = AgentClient(rt.agent)
        self.state = "starting"
        self.started_at = time.time()
        self.ready_ms: float | None = None  # process start -> agent answered
        self._incoming: snapshot_files.SnapshotFiles | None = None
        self.volumes: list[Attachment] = []  # in device order: serial forkd-vol<i>

    async def _qmp(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT_S
    ) -> Any:
        """One QMP command; a QEMU that stops answering is an error, not a hang."""
        try:
            return await asyncio.wait_for(self.qmp.execute(cmd, args), timeout)
        except TimeoutError as exc:
            raise VMError(f"QEMU of {self.id} did not answer {cmd!r} within {timeout:g} s") from exc
        except (QMPError, OSError) as exc:  # a refusal, or the connection went (QEMU died)
            raise VMError(f"QMP {cmd!r} to {self.id} failed: {exc}") from exc

    # ---------------------------------------------------------------- start

    @classmethod
    def _prepare_runtime(cls, run_root: Path, vm_id: str) -> RuntimePaths:
        rt = RuntimePaths(run_root / vm_id)
        if len(str(rt.agent)) > UNIX_PATH_MAX:
            raise VMError(f"run directory {rt.dir} is too long for unix sockets")
        rt.dir.mkdir(parents=True, exist_ok=False)
        return rt

    @classmethod
    def _spawn(cls, argv: list[str], rt: RuntimePaths, detach: bool) -> subprocess.Popen[bytes]:
        try:
            hosttools.require(QEMU_BINARY)
            return cls._popen(argv, rt, detach)
        except BaseException:
            shutil.rmtree(rt.dir, ignore_errors=True)
            raise

    @staticmethod
    def _popen(argv: list[str], rt: RuntimePaths, detach: bool) -> subprocess.Popen[bytes]:
        with rt.qemu_log.open("ab") as log_f:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_f,
                stderr=log_f,
                close_fds=True,
                start_new_session=detach,
                preexec_fn=None if detach else _die_with_parent,
            )

    @classmethod
    async def boot(
        cls,
        image: Image,
        *,
        run_root: Path,
        memory_mib: int = 256,
        vcpus: int = 1,
        accel_name: str | None = None,
        vm_id: str | None = None,
        boot_timeout: float = 90.0,
        internet: bool = True,
        detach: bool = False,
        attach: Sequence[Attachment] = (),
    ) -> VM:
        """Cold-boot a VM from ``image``; returns once its agent answers.

        ``attach``: volumes (see :mod:`forkd.vmm.volumes`), mounted in the
        guest before this returns.
        """
        if not MIN_MEMORY_MIB <= memory_mib <= 65536:
            raise VMError(
                f"memory_mib must be between {MIN_MEMORY_MIB} and 65536, not {memory_mib}"
            )
        if not 1 <= vcpus <= 64:
            raise VMError(f"vcpus must be between 1 and 64, not {vcpus}")
        vm_id = vm_id or new_vm_id()
        choice = accel.choose(accel_name)
        machine = MachineConfig(
            memory_mib=memory_mib,
            vcpus=vcpus,
            accel=choice.name,
            vmlinuz=image.vmlinuz,
            initrd=image.initrd,
            rootfs=image.rootfs,
            internet=internet,
            cmdline=kernel_cmdline(choice.name),
        )
        rt = cls._prepare_runtime(run_root, vm_id)
        with rt.ram.open("wb") as f:  # sparse: costs nothing until written
            f.truncate(memory_mib << 20)
        argv = build_argv(machine, rt, ram_file=rt.ram, incoming=False, volumes=attach)
        started = time.monotonic()
        proc = cls._spawn(argv, rt, detach)
        image_meta = {"name": image.name, "key": image.key, "dir": str(image.dir)}
        vm = cls(vm_id, rt, machine, rt.ram, image_meta, None, proc, proc.pid)
        vm.volumes = list(attach)
        try:
            await vm._connect_qmp()
            await vm.agent.connect()
            await vm._wait_agent(boot_timeout)
            await vm._mount_volumes()
        except BaseException:
            await vm.kill()
            raise
        vm.ready_ms = (time.monotonic() - started) * 1000
        vm.state = "running"
        vm._write_meta()
        return vm

    @classmethod
    async def restore(
        cls,
        snapshot_dir: Path,
        *,
        run_root: Path,
        vm_id: str | None = None,
        hostname: str | None = None,
        timeout: float = 30.0,
        detach: bool = False,
        internet: bool | None = None,
    ) -> VM:
        """Fork a new VM from a snapshot directory; returns once its agent answered.

        After the restore the guest is told the wall-clock time, given fresh
        entropy (kernel RNG and the warm interpreter's ``random``) and a new
        hostname, so no two children share random numbers.
        """
        started = time.monotonic()
        vm = await cls.spawn_incoming(
            snapshot_dir, run_root=run_root, vm_id=vm_id, detach=detach, internet=internet
        )
        await vm.finish_restore(hostname=hostname, timeout=timeout, started=started)
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
    ) -> VM:
        """Start QEMU for a fork of ``snapshot_dir`` and leave it waiting for its state.

        The first half of :meth:`restore`; :meth:`finish_restore` is the
        second. Starting QEMU is a good part of a fork's latency, so
        :class:`forkd.vmm.pool.ForkPool` keeps a few of these ready.
        """
        snap = snapshot_files.load(snapshot_dir)
        machine = snap.machine
        if internet is not None and internet != machine.internet:
            # A netdev option, not a device: the restored state still fits.
            machine = dataclasses.replace(machine, internet=internet)
        vm_id = vm_id or new_vm_id()
        rt = cls._prepare_runtime(run_root, vm_id)
        frozen = [Attachment.from_json(v) for v in snap.meta.get("volumes") or []]
        attach: list[Attachment] = []
        try:
            for f in frozen:  # a writable volume: this child's own layer over the snapshot's
                attach.append(volumes.attach_for_fork(f))
        except BaseException:
            _remove_layers(attach)
            shutil.rmtree(rt.dir, ignore_errors=True)
            raise
        argv = build_argv(machine, rt, ram_file=snap.memory, incoming=True, volumes=attach)
        try:
            proc = cls._spawn(argv, rt, detach)
        except BaseException:
            _remove_layers(attach)
            raise
        vm = cls(vm_id, rt, machine, snap.memory, snap.meta.get("image", {}), snap.dir, proc,
                 proc.pid)  # fmt: skip
        vm.volumes = attach
        vm.state = "incoming"
        vm._incoming = snap
        try:
            await vm._connect_qmp()
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def finish_restore(
        self, *, hostname: str | None = None, timeout: float = 30.0, started: float | None = None
    ) -> None:
        """Load the snapshot's state into a VM from :meth:`spawn_incoming` and run it.

        ``ready_ms`` counts from ``started`` (default: now) to the agent's answer.
        """
        snap = self._incoming
        if snap is None or self.state != "incoming":
            raise VMError(f"{self.id} is not waiting for a snapshot's state")
        started = time.monotonic() if started is None else started
        try:
            self._raise_if_dead("QEMU waiting for the snapshot's state exited")
            await self._load_vmstate(snap.vmstate, timeout)
            await self.agent.connect()
            await self._qmp("cont")
            self.state = "running"
            await self._after_restore(hostname or self.id, timeout, snap)
        except VMError as exc:
            # QEMU gone mid-restore: name the files a damaged snapshot could be.
            dead = await self.gone()
            said = _tail(self.rt.qemu_log, 500) or "nothing"
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
        self._write_meta()

    @classmethod
    async def adopt(cls, run_dir: Path, timeout: float = 10.0) -> VM:
        """Take over a VM that an earlier process started (detached) in ``run_dir``.

        Raises :class:`VMError` when its QEMU is gone, is not the process the
        metadata names, or its agent does not answer.
        """
        rt = RuntimePaths(run_dir)
        try:
            data = json.loads(rt.meta.read_text())
        except (OSError, ValueError) as exc:
            raise VMError(f"cannot read {rt.meta}: {exc}") from exc
        pid = int(data["pid"])
        if not qemu_pid_matches(pid, run_dir):
            raise VMError(f"QEMU of {data.get('id')} (pid {pid}) is no longer running")
        origin = data.get("origin_snapshot")
        vm = cls(
            data["id"],
            rt,
            MachineConfig.from_json(data["machine"]),
            Path(data["ram_file"]),
            data.get("image", {}),
            Path(origin) if origin else None,
            None,
            pid,
        )
        vm.started_at = float(data.get("started_at_unix", time.time()))
        vm.volumes = [Attachment.from_json(v) for v in data.get("volumes") or []]
        await vm._connect_qmp(timeout)
        status = await vm._qmp("query-status")
        assert isinstance(status, dict)
        if status.get("status") == "paused":
            # A daemon that died mid-branch left it paused: let it run again.
            await vm._qmp("cont")
        await vm.agent.connect(timeout)
        await vm._wait_agent(timeout)
        vm.state = "running"
        return vm

    async def _connect_qmp(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_dead("QEMU exited while starting")
            if self.rt.qmp.exists():
                try:
                    await asyncio.wait_for(self.qmp.connect(str(self.rt.qmp)), QMP_TIMEOUT_S)
                    return
                except (QMPError, TimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise VMError(f"cannot connect to QMP at {self.rt.qmp}: {exc}") from exc
            if time.monotonic() > deadline:
                raise VMError(f"QEMU did not open {self.rt.qmp} within {timeout:g} s")
            await asyncio.sleep(0.002)

    async def _load_vmstate(self, vmstate: Path, timeout: float) -> None:
        fd = os.open(vmstate, os.O_RDONLY)
        try:
            self.qmp.send_fd_scm(fd)
            await self._qmp("getfd", {"fdname": "vmstate"})
        finally:
            os.close(fd)
        await self._qmp("migrate-incoming", {"uri": "fd:vmstate"})
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = await self._qmp("query-status")
            except VMError as exc:
                raise SnapshotError(
                    f"loading {vmstate} failed (QEMU: {_tail(self.rt.qemu_log) or exc})"
                ) from exc
            assert isinstance(status, dict)
            if status["status"] != "inmigrate":
                break
            if time.monotonic() > deadline:
                raise SnapshotError(f"loading {vmstate} did not finish within {timeout:g} s")
            await asyncio.sleep(0.002)
        mig = await self._qmp("query-migrate")
        assert isinstance(mig, dict)
        if mig.get("status") not in (None, "completed"):
            raise SnapshotError(
                f"loading {vmstate} failed: migration {mig.get('status')} "
                f"({mig.get('error-desc') or _tail(self.rt.qemu_log)})"
            )

    async def _after_restore(
        self, hostname: str, timeout: float, snap: snapshot_files.SnapshotFiles
    ) -> None:
        try:
            result = await self.agent.call(
                "restore",
                {
                    "time_ns": time.time_ns(),
                    "entropy": base64.b64encode(os.urandom(64)).decode(),
                    "hostname": hostname,
                },
                wait=timeout,
            )
        except AgentError as exc:
            self._raise_if_dead(f"the guest restored from {snap.memory} died")
            raise SnapshotError(
                f"the guest restored from {snap.memory} does not answer ({exc}); "
                f"memory.bin or vmstate may be corrupt. Console: {await self.console_tail()}"
            ) from exc
        if result.get("errors"):
            log.warning("restore of %s: %s", self.id, "; ".join(result["errors"]))

    async def _wait_agent(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_dead("QEMU exited during boot")
            try:
                await self.agent.call("ping", wait=2.0)
                return
            except AgentError as exc:
                if time.monotonic() > deadline:
                    raise VMError(
                        f"the guest agent did not answer within {timeout:g} s ({exc}). "
                        f"Console: {_tail(self.rt.console)}"
                    ) from exc

    def _write_meta(self) -> None:
        data = {
            "id": self.id,
            "pid": self.pid,
            "qmp": str(self.rt.qmp),
            "agent": str(self.rt.agent),
            "ram_file": str(self.ram_file),
            "origin_snapshot": str(self.origin) if self.origin else None,
            "machine": self.machine.to_json(),
            "image": self.image,
            "started_at_unix": self.started_at,
            "volumes": [v.to_json() for v in self.volumes],
        }
        tmp = self.rt.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.rt.meta)

    # ------------------------------------------------------------ lifecycle

    def is_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        # Not our child (re-adopted): the pid alone could have been reused.
        return qemu_pid_matches(self.pid, self.rt.dir)

    async def _mount_volumes(self) -> None:
        for i, att in enumerate(self.volumes):
            opts = "ro,noload" if att.readonly else "rw"
            # Values travel as positional arguments: no string is pasted into the script.
            argv = ["/bin/sh", "-c", MOUNT_SCRIPT, "sh", f"forkd-vol{i}", att.path, opts]
            res = await self.exec(argv, timeout=60)
            if res["exit_code"] != 0:
                raise VMError(
                    f"mounting volume {att.name} at {att.path} failed: {res['stderr'].strip()}"
                )

    async def _freeze_volumes(self) -> list[Attachment]:
        """At a pause: freeze each writable volume's layer for a snapshot (VM paused).

        QEMU gives the VM a new empty layer above the current one, which from
        now on no one writes; the snapshot keeps that frozen chain.
        """
        frozen: list[Attachment] = []
        for i, att in enumerate(self.volumes):
            frozen.append(att)
            if att.readonly:
                continue
            new = volumes.layer_path(att.chain)
            await self._qmp(
                "blockdev-snapshot-sync",
                {"device": f"vol{i}", "snapshot-file": str(new), "format": "qcow2"},
            )
            self.volumes[i] = Attachment(att.name, att.path, False, (str(new), *att.chain))
        if frozen:
            self._write_meta()
        return frozen

    async def console_tail(self, limit: int = 800) -> str:
        """The end of the guest's console: its file, or its ring buffer for a fork."""
        if self.rt.console.exists():
            return _tail(self.rt.console, limit)
        try:
            data = await self._qmp(
                "ringbuf-read", {"device": "console", "size": limit, "format": "utf8"}, 5.0
            )
        except (VMError, OSError):
            return ""
        return str(data).strip()

    async def gone(self, wait: float = 1.0) -> bool:
        """Whether QEMU has exited, allowing ``wait`` seconds for one that is exiting.

        After QMP's connection drops, the process may still be tearing down.
        """
        deadline = time.monotonic() + wait
        while self.is_alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _raise_if_dead(self, what: str) -> None:
        if not self.is_alive():
            self.state = "dead"
            code = self._proc.returncode if self._proc else "?"
            qemu = _tail(self.rt.qemu_log) or "(nothing)"
            console = _tail(self.rt.console, 800) or "(nothing)"
            raise VMError(
                f"{what} (exit status {code}). QEMU said: {qemu} Guest console: {console}"
            )

    async def pause(self) -> None:
        """Freeze the vCPUs (QMP ``stop``)."""
        await self._run_state("stop", "pausing", "paused")

    async def resume(self) -> None:
        """Let the vCPUs run again (QMP ``cont``)."""
        await self._run_state("cont", "resuming", "running")

    async def _run_state(self, cmd: str, doing: str, state: str) -> None:
        try:
            await self._qmp(cmd)
        except VMError as exc:
            self._raise_if_dead(f"QEMU of {self.id} died")
            raise VMError(f"{doing} {self.id} failed: {exc}") from exc
        self.state = state

    async def kill(self) -> None:
        """Stop the VM for good and remove its runtime files."""
        await self.agent.close()
        with contextlib.suppress(Exception):
            await self.qmp.disconnect()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            await asyncio.to_thread(self._proc.wait)
        elif qemu_pid_matches(self.pid, self.rt.dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.state = "dead"
        _remove_layers(self.volumes)
        shutil.rmtree(self.rt.dir, ignore_errors=True)

    # ------------------------------------------------------------- snapshot

    async def begin_snapshot(self, dest: Path) -> SnapshotWriter:
        """Stage a snapshot of this VM at ``dest`` (which must not exist)."""
        if dest.exists():
            raise SnapshotError(f"{dest} already exists")
        writer = SnapshotWriter(self, dest)
        await writer.prepare()
        return writer

    async def snapshot(self, dest: Path, extra_meta: dict[str, Any] | None = None) -> Path:
        """Pause, snapshot to ``dest``, resume. The VM keeps running afterwards.

        On failure nothing is left at ``dest`` and the VM is resumed if it is
        still alive (see :mod:`forkd.vmm.live_snapshot`). Returns ``dest``;
        the pause window is recorded in ``snapshot.json`` as ``pause_ms``.
        """
        if self.state == "dead" or not self.is_alive():
            raise SnapshotError(f"cannot snapshot {self.id}: its QEMU is not running")
        if self.state == "running":
            try:
                result = await live_snapshot.snapshot_running(self, dest, extra_meta or {})
            except live_snapshot.LiveSnapshotError as exc:
                cause = exc.__cause__
                if isinstance(cause, SnapshotError) and not exc.snapshot_kept:
                    raise cause from None
                raise SnapshotError(str(exc)) from exc
            return result.dir
        writer = await self.begin_snapshot(dest)  # already paused: no pause window
        try:
            await writer.capture()
        except BaseException:
            await writer.abort()
            raise
        return await writer.commit(extra_meta)

    # --------------------------------------------------------- guest agent

    async def ping(self) -> dict[str, Any]:
        return await self.agent.call("ping", wait=10.0)

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float = 30.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
    ) -> dict[str, Any]:
        params = {"argv": argv, "cwd": cwd, "env": env, "stdin": stdin, "timeout": timeout}
        return await self.agent.call("exec", params, wait=timeout + 10.0)

    async def eval(self, code: str, timeout: float = 60.0) -> dict[str, Any]:
        return await self.agent.call("eval", {"code": code}, wait=timeout)

    async def read_file(self, path: str) -> bytes:
        result = await self.agent.call("file_read", {"path": path})
        return base64.b64decode(result["data"])

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        params = {"path": path, "data": base64.b64encode(data).decode(), "mode": mode}
        result = await self.agent.call("file_write", params)
        return int(result["size"])

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        return (await self.agent.call("file_list", {"path": path}))["entries"]

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self.agent.call("file_remove", {"path": path, "recursive": recursive})

    # --------------------------------------------------------------- memory

    def memory_usage(self) -> dict[str, int]:
        """Host memory of the QEMU process, from /proc/PID/smaps_rollup (bytes)."""
        out: dict[str, int] = {}
        with open(f"/proc/{self.pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key.strip().lower()] = int(parts[0]) * 1024
        # What this VM alone costs the host: pages only it has written (QEMU's
        # heap, the TCG cache, guest pages it changed). Private_Clean is left
        # out: it counts snapshot pages that happen to be mapped by no other
        # child right now, which are page cache, not owned memory.
        out["private"] = out.get("private_dirty", 0)
        return out


class SnapshotWriter:
    """A snapshot of one VM being built in a staging directory."""

    def __init__(self, vm: VM, dest: Path) -> None:
        self.vm = vm
        self.dest = dest
        self.staging = dest.parent / f".{dest.name}.partial-{secrets.token_hex(3)}"
        self.stats = memory.DumpStats()
        self.pause_started: float | None = None
        self.capture_ms: float | None = None
        self._mem_fd: int | None = None
        self._region: memory.RamRegion | None = None
        # Pages read during the pause, written after the resume (in commit).
        self._deferred = memory.DeferredWrites(limit=DEFERRED_WRITE_LIMIT)
        self.volumes: list[Attachment] = []  # as frozen for this snapshot

    async def prepare(self) -> None:
        """Create the staging directory and clone the RAM file's base (VM may run)."""
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir()
            vm = self.vm
            size = vm.machine.memory_mib << 20
            self._region = memory.find_ram_region(vm.pid, vm.ram_file, size)
            self._mem_fd = os.open(
                self.staging / snapshot_files.MEMORY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
            )
            self.stats = await asyncio.to_thread(memory.clone_base, self._region, self._mem_fd)
        except BaseException as exc:
            await self.abort()
            raise await self._translate(exc, "preparing") from exc

    async def capture(self) -> None:
        """Write vmstate and the guest's written pages. The VM must be paused."""
        vm = self.vm
        assert self._region is not None and self._mem_fd is not None
        started = time.monotonic()
        try:
            self.volumes = await vm._freeze_volumes()
            await vm._qmp(
                "xen-save-devices-state",
                {"filename": str(self.staging / snapshot_files.VMSTATE), "live": False},
            )
            await asyncio.to_thread(
                memory.dump_written_pages,
                self._region,
                self._mem_fd,
                base_is_empty=self.stats.base_bytes_cloned == 0,
                stats=self.stats,
                defer=self._deferred,
            )
        except BaseException as exc:
            raise await self._translate(exc, "capturing") from exc
        self.capture_ms = (time.monotonic() - started) * 1000

    async def _translate(self, exc: BaseException, step: str) -> BaseException:
        if not isinstance(exc, Exception):
            return exc
        vm = self.vm
        if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: the VM is fine
            return SnapshotError(
                f"disk full while writing snapshot {self.dest.name} under {self.dest.parent}"
            )
        # Anything else may be QEMU dying (SIGKILL): give it a moment to be gone.
        if await vm.gone(wait=0.5):
            vm.state = "dead"
            return SnapshotError(
                f"QEMU of {vm.id} died while {step} the snapshot {self.dest.name}: "
                f"{_tail(vm.rt.qemu_log, 500) or exc}"
            )
        if isinstance(exc, SnapshotError):
            return exc
        return SnapshotError(f"{step} snapshot {self.dest.name} of {vm.id} failed: {exc}")

    async def commit(self, extra_meta: dict[str, Any] | None = None) -> Path:
        """Write snapshot.json, flush, and rename the staging directory to ``dest``."""
        vm = self.vm
        try:
            assert self._mem_fd is not None
            await asyncio.to_thread(
                self._deferred.flush,
                self._mem_fd,
                base_is_empty=self.stats.base_bytes_cloned == 0,
                stats=self.stats,
            )
            await asyncio.to_thread(os.fsync, self._mem_fd)
            os.close(self._mem_fd)
            self._mem_fd = None
            vmstate = self.staging / snapshot_files.VMSTATE
            meta: dict[str, Any] = {
                "format": snapshot_files.FORMAT,
                "created_at_unix": int(time.time()),
                "forkd_version": __version__,
                "image": vm.image,
                "machine": vm.machine.to_json(),
                "memory_bytes": vm.machine.memory_mib << 20,
                "vmstate_bytes": vmstate.stat().st_size,
                "source_vm": vm.id,
                "parent_snapshot": str(vm.origin) if vm.origin else None,
                "capture_ms": round(self.capture_ms or 0.0, 1),
                "pages_written": self.stats.pages_written,
                "base_bytes_cloned": self.stats.base_bytes_cloned,
            }
            meta.update(extra_meta or {})
            # What the guest saw at the pause: name, mount point, mode, frozen chain.
            meta["volumes"] = [v.to_json() for v in self.volumes]
            meta_path = self.staging / snapshot_files.META
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
            for path in (vmstate, meta_path, self.staging):
                _fsync_path(path)
            self.staging.rename(self.dest)
            _fsync_path(self.dest.parent)
        except BaseException as exc:
            await self.abort()
            if isinstance(exc, OSError) and exc.errno == 28:
                raise SnapshotError(
                    f"disk full while writing snapshot {self.dest.name} under {self.dest.parent}"
                ) from exc
            raise
        return self.dest

    async def abort(self) -> None:
        """Remove everything this snapshot wrote."""
        self._deferred.runs.clear()
        if self._mem_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._mem_fd)
            self._mem_fd = None
        await asyncio.to_thread(shutil.rmtree, self.staging, True)
