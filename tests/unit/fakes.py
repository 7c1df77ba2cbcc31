"""A fake VM driver for unit tests of the services, the app, the SDK and the CLI.

Everything but QEMU is real: snapshots are real directories with a real
``snapshot.json`` (written by :mod:`forkd.vmm.snapshot.files`), a sparse
``memory.bin`` and a ``vmstate``, so the registry, reconcile and validation
code run as they do in production. A fake VM keeps its guest's files in a
dict, runs ``eval`` in a Python namespace of its own, and copies both into
its snapshots, so children see what their parent had. Failures are injected
at an exact step with ``FakeVM.fail``.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkd import agent_wire as wire
from forkd import agent_wire_entries as entries
from forkd.errors import AgentError, SnapshotError, VMError
from forkd.states import VMState
from forkd.vmm.agent.answers import checked, listed
from forkd.vmm.jail.network import SandboxNet
from forkd.vmm.qemu.argv import KERNEL_CMDLINE, RUNTIME_CMDLINE, MachineConfig
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.snapshot import memory_diff
from forkd.vmm.snapshot.files import BaseRef, ImageRef, SnapshotLabels, SnapshotMeta
from forkd.vmm.vm_state import VMLifecycle
from forkd.vmm.volumes.disks import Attachment
from tests.unit.fake_entries import FakeEntries
from tests.unit.fake_files import FakeTransfers
from tests.unit.fake_processes import FakeProcesses

GUEST_STATE = "fake-guest.json"  # beside the real files: what the fake guest had
CLOSED_PORT = 9  # discard: nothing listens on a test host's loopback there
PRIVATE_MIB = 64  # a fake QEMU's own memory, as VM.memory_usage measures a real one's


def make_image(cache_dir: Path, name: str = "python") -> Path:
    """A fake built image ``name`` in ``cache_dir`` (what ``FORKD_CACHE_DIR`` names)."""
    images = cache_dir / "images"
    d = images / f"{name}-0000000000000000"
    d.mkdir(parents=True, exist_ok=True)
    for f in ("vmlinuz", "initrd.img", "rootfs.sqfs"):
        (d / f).write_bytes(b"fake")
    (d / "image.json").write_text(json.dumps({"name": name, "key": "0000000000000000"}))
    (images / f"{name}.json").write_text(json.dumps({"key": "0000000000000000"}))
    return d


@dataclass
class Runtime:
    dir: Path


@dataclass
class GuestContents:
    """What a fake guest holds: files, the warm interpreter's names and the agent's
    image defaults (``configure``: env, cwd, user), all kept in a snapshot."""

    files: dict[str, bytes] = field(default_factory=dict)
    names: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        plain = {k: v for k, v in self.names.items() if isinstance(v, int | float | str | bool)}
        return {
            "files": {k: v.decode("latin-1") for k, v in self.files.items()},
            "names": plain,
            "defaults": self.defaults,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestContents:
        files = {k: v.encode("latin-1") for k, v in data["files"].items()}
        return cls(files, dict(data["names"]), dict(data.get("defaults") or {}))

    def user(self, asked: str | None) -> str:
        """Who a command runs as: the one asked for, else the image's USER, else root."""
        return asked or self.defaults.get("user") or "root"


class FakeWriter:
    """A snapshot being staged, as :class:`forkd.vmm.snapshot.writer.SnapshotWriter`."""

    def __init__(self, vm: FakeVM, dest: Path, base: BaseRef | None = None) -> None:
        self.vm, self.dest, self.base = vm, dest, base
        self.staging = dest.parent / f".{dest.name}.partial-fake"
        self.staging.mkdir(parents=True)
        (self.staging / "memory.bin").write_bytes(b"partial")
        self.contents: GuestContents | None = None

    async def capture(self) -> None:
        vm = self.vm
        vm.events.append("capture")
        if vm.fail == "capture":
            raise SnapshotError(f"disk full while writing snapshot {self.dest.name}")
        if vm.fail == "capture-kill":
            vm.alive = False
            raise SnapshotError("QEMU died while capturing")
        self.contents = GuestContents.from_json(
            vm.contents.to_json()
        )  # plain values, as a snapshot keeps
        await asyncio.sleep(vm.capture_delay)

    async def commit(self, labels: SnapshotLabels | None = None) -> SnapshotMeta:
        vm = self.vm
        vm.events.append("commit")
        await asyncio.sleep(vm.commit_delay)  # the source already runs again
        labels = labels or SnapshotLabels()
        if self.base is not None:  # a diff: no pages of its own (the guest is in GUEST_STATE)
            (self.staging / "memory.bin").unlink()
            with (self.staging / snapshot_files.MEMORY_DIFF).open("wb") as f:
                f.truncate(vm.machine.memory_mib << 20)
            memory_diff.write_runs(self.staging / snapshot_files.MEMORY_RUNS, [])
        else:
            with (self.staging / "memory.bin").open("wb") as f:
                f.truncate(vm.machine.memory_mib << 20)
        (self.staging / "vmstate").write_bytes(b"state")
        (self.staging / GUEST_STATE).write_text(
            json.dumps((self.contents or vm.contents).to_json())
        )
        meta = SnapshotMeta(
            machine=vm.machine,
            image=vm.image_ref,
            created_at_unix=int(time.time()),
            memory_bytes=vm.machine.memory_mib << 20,
            vmstate_bytes=5,
            source_vm=vm.id,
            parent_snapshot=None,
            capture_ms=1.0,
            pages_written=0,
            base_bytes_cloned=0,
            tag=labels.tag,
            branched_from=labels.branched_from,
            parent_tag=labels.parent_tag,
            pause_ms=labels.pause_ms,
            volumes=tuple(vm.volumes),
            mode="diff" if self.base else "full",
            base=self.base,
            chain=(self.base,) if self.base else (),
            id=snapshot_files.new_id(),
            parent_id=vm.origin_id,
        )
        snapshot_files.write_meta(self.staging, meta)
        self.staging.rename(self.dest)
        return meta

    async def abort(self) -> None:
        self.vm.events.append("abort")
        shutil.rmtree(self.staging, ignore_errors=True)


class FakeVM(VMLifecycle):
    """Moves along the real VM's state table (VMLifecycle): a service that drives a VM
    through a move the real one refuses fails here too."""

    def __init__(
        self,
        vm_id: str,
        machine: MachineConfig,
        run_root: Path,
        contents: GuestContents,
        state: VMState = VMState.RUNNING,  # as it was made: booted, restored or adopted
    ) -> None:
        self.id = vm_id
        self._state = state
        self.machine = machine
        self.origin: Path | None = None  # the snapshot directory it was forked from
        self.origin_id: str | None = None  # and that snapshot's id
        self.rt = Runtime(run_root / vm_id)
        self.rt.dir.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()  # never one a test would kill: lifecycle checks it is QEMU
        self.alive = True
        self.fail: str | None = None
        self.capture_delay = 0.0  # inside the pause
        self.commit_delay = 0.0  # after it: a branch with wait false is pending meanwhile
        self.events: list[str] = []
        self.volumes: list[Attachment] = []
        self.net: SandboxNet | None = None  # no namespace: user-mode networking
        self.ready_ms: float | None = 1.0
        self.seed: int | None = None  # what its restore or claim was given
        self.image_name = "python"
        self.image_ref = ImageRef("python", None, None)  # a booted VM's: its image's dir too
        self.contents = contents
        self.processes = FakeProcesses()
        self.guest_stats: dict[str, Any] = {}  # what a test makes its guest's stats say
        self.transfers = FakeTransfers(contents.files)
        self.entries = FakeEntries(lambda: self.contents.files, self._home)
        self.eval_timeouts: list[float] = []  # timeout of each eval, as the service asked
        self.contexts: dict[str, dict[str, Any]] = {}  # eval contexts (a fork has none)
        # Guest TCP port -> a loopback port where a test's server plays the guest's service.
        self.ports: dict[int, int] = {}

    # lifecycle ---------------------------------------------------------------
    def is_alive(self) -> bool:
        return self.alive

    def set_egress(self, policy: Any) -> None:
        self.machine = dataclasses.replace(
            self.machine, egress=policy.to_json(), internet=not policy.shut
        )

    async def kill(self) -> None:
        self.events.append("kill")
        self.alive = False
        self._set_state(VMState.DEAD)
        shutil.rmtree(self.rt.dir, ignore_errors=True)

    async def release(self) -> None:
        self.events.append("release")

    def memory_usage(self) -> dict[str, int]:  # what a pool under its memory cap reads
        held = PRIVATE_MIB << 20
        return {"rss": held, "pss": held, "private_dirty": held, "private": held}

    cpu_used = 1.5  # seconds of CPU its QEMU used (a test moves it)

    def cpu_times(self) -> tuple[float, float]:
        return self.cpu_used, 10.0

    async def stats(self, paths: list[str]) -> wire.StatsAnswer:
        self._agent("stats")
        mounts = {p: {"total_bytes": 1 << 30, "used_bytes": 1 << 20} for p in paths}
        return checked(
            wire.STATS,
            {
                "cpu": {"busy_s": 3.0, "idle_s": 30.0, "count": 1},
                "memory": {"total_bytes": 256 << 20, "used_bytes": 40 << 20},
                "disk": {"total_bytes": 2 << 30, "used_bytes": 300 << 20},
                "mounts": mounts,
                "network": {"rx_bytes": 1000, "tx_bytes": 2000},
                "processes": 12,
                "load": [0.0, 0.0, 0.0],
                **self.guest_stats,
            },
        )

    def resident_memory(self) -> dict[str, int]:  # what admission by real memory reads
        held = PRIVATE_MIB << 20
        return {"rss": held, "anon": held, "file": 0, "shmem": 0}

    async def finish_restore(self, *, seed: int | None = None, **_: Any) -> None:
        self._set_state(VMState.RUNNING)
        self.seed = seed

    async def prewarm(self) -> None:  # a pooled VM restored ahead of time, stopped
        self.events.append("prewarm")
        self._set_state(VMState.RUNNING)  # restored, one command run, then stopped
        self._set_state(VMState.WARM)

    async def claim(self, *, seed: int | None = None) -> None:
        self.events.append("claim")
        self.seed = seed
        if self.fail == "claim":
            self.alive = False
            raise VMError("cont failed")
        self._set_state(VMState.RUNNING)

    async def pause(self) -> None:
        self.events.append("pause")
        if self.fail == "pause":
            raise VMError("stop refused")
        self._set_state(VMState.PAUSED)

    async def resume(self) -> None:
        self.events.append("resume")
        if self.fail == "resume":
            self.alive = False
            raise VMError("cont failed")
        self._set_state(VMState.RUNNING)

    async def after_resume(self) -> None:
        self._agent("restore")
        self.events.append("after_resume")

    async def begin_snapshot(
        self, dest: Path, base: BaseRef | None = None, *, live: bool = False
    ) -> FakeWriter:
        self.events.append("begin-diff" if base is not None else "begin-live" if live else "begin")
        if dest.exists():
            raise SnapshotError(f"{dest} already exists")
        if self.fail == "begin":
            raise SnapshotError("staging the snapshot failed")
        return FakeWriter(self, dest, base)

    async def snapshot(self, dest: Path, labels: SnapshotLabels | None = None) -> Path:
        writer = await self.begin_snapshot(dest)
        await writer.capture()
        await writer.commit(labels)
        return dest

    # guest -------------------------------------------------------------------
    @property
    def guest(self) -> FakeVM:
        """The fake plays its own guest: the agent's calls are its methods (so a test
        patches one on the class)."""
        return self

    def _agent(self, op: str) -> None:
        if not self.alive:
            raise AgentError("agent connection closed")
        if self.state == "paused":  # its vCPUs are stopped: nothing answers
            raise AgentError(f"agent did not answer {op!r} within 1 s (paused)")
        if self.fail == op:
            raise AgentError(f"agent did not answer {op!r} within 1 s")

    async def guest_port_address(self, port: int) -> tuple[str, int]:
        """As VM's: where the daemon connects for guest ``port`` (none listening: a closed one)."""
        from forkd.vmm.agent.ports import check_guest_port

        check_guest_port(port)
        return "127.0.0.1", self.ports.get(port, CLOSED_PORT)

    async def ping(self) -> wire.PingAnswer:
        self._agent("ping")
        return {"pong": True, "pid": 1, "hostname": self.id, "agent_version": "fake"}

    async def exec(self, argv: list[str], *, timeout: float = 30.0, **kw: Any) -> wire.ExecAnswer:
        self._agent("exec")
        if argv[:1] == ["nap"]:  # takes its time, as a real command does (sleep does not)
            await asyncio.sleep(min(float(argv[1]), timeout))
            argv = ["sleep", *argv[1:]]
        if argv[:1] == ["sleep"] and float(argv[1]) > timeout:  # killed, as the agent does
            return {
                "stdout": "",
                "stderr": "",
                "exit_code": 124,
                "timed_out": True,
                "duration_ms": timeout * 1000,
            }
        if argv in (["whoami"], ["id", "-un"], ["/bin/sh", "-c", "id -un"]):
            return {
                "stdout": self.contents.user(kw.get("user")) + "\n",
                "stderr": "",
                "exit_code": 0,
                "timed_out": False,
                "duration_ms": 1.0,
            }
        if argv[:2] == ["tail", "-c"] and argv[-1] in self.contents.files:  # tail -c N -- PATH
            data = self.contents.files[argv[-1]][-int(argv[2]) :]
            return {
                "stdout": data.decode(),
                "stderr": "",
                "exit_code": 0,
                "timed_out": False,
                "duration_ms": 1.0,
            }
        if argv == ["env", "-0"]:  # the image's environment, as the agent gives commands
            env = {"PATH": "/usr/bin:/bin", **(self.contents.defaults.get("env") or {})}
            return {
                "stdout": "".join(f"{k}={v}\0" for k, v in env.items()),
                "stderr": "",
                "exit_code": 0,
                "timed_out": False,
                "duration_ms": 1.0,
            }
        if argv == ["/bin/sh", "-c", "false"]:  # a shell line that fails, as a shell runs it
            argv = ["exit", "1"]
        if argv[:1] == ["exit"]:
            code = int(argv[1])
            return {
                "stdout": "",
                "stderr": f"exit {code}\n",
                "exit_code": code,
                "timed_out": False,
                "duration_ms": 1.0,
            }
        return {
            "stdout": " ".join(argv[1:]) + "\n",
            "stderr": "",
            "exit_code": 0,
            "timed_out": False,
            "duration_ms": 1.0,
        }

    async def eval_peek(self, tag: str, stdout_from: int, stderr_from: int) -> wire.EvalPeekAnswer:
        self._agent("eval_peek")
        return {"running": False, "stdout": "", "stderr": ""}  # a fake eval is over at once

    async def eval(
        self, code: str, timeout: float = 60.0, tag: str | None = None, context: str | None = None
    ) -> wire.EvalAnswer:
        self._agent("eval")
        self.eval_timeouts.append(timeout)
        if context is None:
            names = self.contents.names
        elif context in self.contexts:  # a fake context runs every language as Python
            names = self.contexts[context]
        else:
            raise AgentError(f"no eval context {context!r}", kind="NoContext")
        out = io.StringIO()
        shown: list[wire.DisplayItem] = []  # display(obj): its repr, as text/plain
        names["display"] = lambda obj: shown.append({"mime": "text/plain", "data": repr(obj)})
        try:
            with contextlib.redirect_stdout(out):
                result = _run(code, names)
        except Exception as exc:  # the whole traceback, as the guest agent answers
            error = 'Traceback (most recent call last):\n  File "<eval>", line 1\n'
            error += f"{type(exc).__name__}: {exc}\n"
            return {
                "result": None,
                "error": error,
                "exit_code": 1,
                "stdout": out.getvalue(),
                "stderr": "",
                "display": shown,
            }
        return {
            "result": result,
            "error": None,
            "exit_code": 0,
            "stdout": out.getvalue(),
            "stderr": "",
            "display": shown,
        }

    async def eval_interrupt(self, context: str | None = None) -> bool:
        self._agent("eval_interrupt")
        return False  # a fake eval is over before anyone could interrupt it

    async def eval_context_open(self, context: str, language: str, cwd: str | None = None) -> bool:
        self._agent("eval_context_open")
        if context in self.contexts:
            return False
        self.contexts[context] = {}
        return True

    async def eval_context_close(self, context: str) -> bool:
        self._agent("eval_context_close")
        return self.contexts.pop(context, None) is not None

    async def configure(self, *, env: dict[str, str], cwd: str | None, user: str | None) -> None:
        self._agent("configure")
        # the image's defaults: the egress CA's variables (set when the daemon has its
        # proxy, tested in test_egress_trust.py) aside
        from forkd.controller.services.egress_trust import ENV as CA_ENV

        image_env = {k: v for k, v in env.items() if CA_ENV.get(k) != v}
        self.image_defaults = {"env": image_env, "cwd": cwd, "user": user}
        self.contents.defaults = {"env": dict(env), "cwd": cwd, "user": user}

    async def env_set(
        self, env: dict[str, str], *, cwd: str | None = None, user: str | None = None
    ) -> None:
        self._agent("env_set")
        defaults = self.contents.defaults
        defaults["env"] = {**(defaults.get("env") or {}), **env}
        if cwd is not None:
            defaults["cwd"] = cwd
        if user is not None:
            defaults["user"] = user

    async def read_file(self, path: str) -> bytes:
        self._agent("file_read")
        if path not in self.contents.files:
            raise AgentError(
                f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError"
            )
        return self.contents.files[path]

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        self._agent("file_write")
        if path.startswith("/proc/"):
            raise AgentError(f"[Errno 13] Permission denied: {path!r}", kind="PermissionError")
        self.contents.files[path] = data
        return len(data)

    async def list_dir(self, path: str) -> list[wire.FileListEntry]:
        """As the real guest's: the agent's answer checked, its bound kept."""
        return listed(checked(wire.FILE_LIST, {"entries": self._listing(path)}))

    def _listing(self, path: str) -> object:
        """The agent's file_list entries (what a test's hostile guest answers instead)."""
        self._agent("file_list")
        if path in self.contents.files:
            raise AgentError(f"[Errno 20] Not a directory: {path!r}", kind="NotADirectoryError")
        prefix = path.rstrip("/") + "/"
        names = sorted(
            {p[len(prefix) :].split("/")[0] for p in self.contents.files if p.startswith(prefix)}
        )
        if not names:
            raise AgentError(
                f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError"
            )
        return [
            {
                "name": n,
                "type": "file",
                "size": len(self.contents.files.get(prefix + n, b"")),
                "mode": 0o644,
                "mtime": 0.0,
            }
            for n in names
        ]

    async def remove(self, path: str, recursive: bool = False) -> None:
        self._agent("file_remove")
        below = [p for p in self.contents.files if p.startswith(path.rstrip("/") + "/")]
        if recursive and (below or path in self.entries.dirs):
            for p in below:
                del self.contents.files[p]
            self.entries.dirs = {d for d in self.entries.dirs if not d.startswith(path)}
            return
        if self.contents.files.pop(path, None) is None:
            raise AgentError(
                f"[Errno 2] No such file or directory: {path!r}", kind="FileNotFoundError"
            )

    # entries and watches: played by FakeEntries --------------------------------
    def _home(self, user: str | None) -> str:
        who = self.contents.user(user)
        return "/root" if who in ("root", "0") else f"/home/{who}"

    async def fs_stat(self, path: str, user: str | None = None) -> entries.FsEntry:
        self._agent("fs_stat")
        return self.entries.stat(path, user)

    async def fs_list(self, path: str, depth: int, user: str | None = None) -> entries.FsListAnswer:
        self._agent("fs_list")
        return self.entries.list(path, depth, user)

    async def fs_mkdir(self, path: str, user: str | None = None) -> entries.FsMkdirAnswer:
        self._agent("fs_mkdir")
        return self.entries.mkdir(path, user)

    async def fs_move(
        self, source: str, destination: str, user: str | None = None
    ) -> entries.FsEntry:
        self._agent("fs_move")
        return self.entries.move(source, destination, user)

    async def watch_open(self, path: str, recursive: bool) -> str:
        self._agent("fs_watch_open")
        return self.entries.watch_open(path, recursive)

    async def watch_read(
        self, watch_id: str, wait_s: float, max_events: int = 1000
    ) -> entries.WatchReadAnswer:
        self._agent("fs_watch_read")
        answer = self.entries.watch_read(watch_id)
        if not answer["events"] and wait_s:
            await asyncio.sleep(min(wait_s, 0.05))  # the real one waits for the kernel
        return answer

    async def watch_close(self, watch_id: str) -> bool:
        self._agent("fs_watch_close")
        return self.entries.watch_close(watch_id)

    # chunked transfers: played by FakeTransfers ------------------------------
    async def upload_open(
        self, path: str, first: bytes, *, tar: bool = False, commit: bool = False
    ) -> wire.UploadOpenAnswer:
        self._agent("file_upload_open")
        return checked(wire.UPLOAD_OPEN, self.transfers.open(path, tar, first, commit))

    async def upload_write(
        self, transfer_id: str, offset: int, data: bytes, *, payload: bool = False
    ) -> int:
        self._agent("file_upload_write")
        self.transfers.payloads.append(payload)
        return self.transfers.write(transfer_id, offset, data)

    async def upload_commit(self, transfer_id: str) -> int:
        self._agent("file_upload_commit")
        return self.transfers.commit(transfer_id)

    async def transfer_abort(self, transfer_id: str) -> None:
        self._agent("file_transfer_abort")
        self.transfers.abort(transfer_id)

    async def read_range(
        self, path: str, offset: int, length: int
    ) -> tuple[bytes, int | None, bool]:
        self._agent("file_read_range")
        return self.transfers.read(path, offset, length)

    async def tar_open(self, path: str) -> str:
        self._agent("file_tar_open")
        return self.transfers.tar_open(path)

    async def tar_open_paths(self, paths: list[str]) -> str:
        self._agent("file_tar_open")
        return self.transfers.tar_open_paths(paths)

    async def fs_manifest_open(self, path: str, max_entries: int) -> wire.ManifestAnswer:
        self._agent("fs_manifest_open")
        return checked(wire.MANIFEST_OPEN, self.transfers.manifest_open(path, max_entries))

    async def fs_lower_stat(self, paths: list[str]) -> list[wire.LowerStat | None]:
        self._agent("fs_lower_stat")
        return [None for _ in paths]  # the fake's image holds no file

    async def tar_read(self, transfer_id: str, length: int) -> tuple[bytes, bool]:
        self._agent("file_tar_read")
        return self.transfers.tar_read(transfer_id, length)

    # background processes: played by FakeProcesses ----------------------------
    async def proc_start(self, cmd: list[str] | str, **kw: Any) -> wire.ProcInfo:
        self._agent("proc_start")
        started = self.processes.start(cmd, **{**kw, "user": self.contents.user(kw.get("user"))})
        return checked(wire.PROC_START, started)

    async def proc_list(self) -> list[wire.ProcInfo]:
        self._agent("proc_list")
        return checked(wire.PROC_LIST, {"processes": self.processes.list()})["processes"]

    async def proc_info(self, pid: int) -> wire.ProcInfo:
        self._agent("proc_info")
        return checked(wire.PROC_INFO, self.processes.info(pid))

    async def proc_read(
        self,
        pid: int,
        offset: int,
        *,
        wait_s: float = 0.0,
        max_bytes: int = 256 << 10,
        min_bytes: int = 1,
        linger_s: float = 0.0,
    ) -> wire.ProcReadAnswer:
        self._agent("proc_read")
        self.processes.asks.append((max_bytes, min_bytes, linger_s))
        return checked(wire.PROC_READ, await self.processes.read(pid, offset, wait_s, max_bytes))

    async def proc_stdin(self, pid: int, data: bytes, eof: bool = False) -> int:
        self._agent("proc_stdin")
        return self.processes.stdin(pid, data, eof)

    async def proc_signal(self, pid: int, signal: int | str) -> None:
        self._agent("proc_signal")
        self.processes.signal(pid, signal)

    async def proc_resize(self, pid: int, cols: int, rows: int) -> None:
        self._agent("proc_resize")
        self.processes.resize(pid, cols, rows)


def _run(code: str, names: dict[str, Any]) -> str | None:
    """Run ``code``; the repr of a final expression, like the agent's eval."""
    tree = ast.parse(code)
    final = tree.body[-1] if tree.body else None
    last = final if isinstance(final, ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, "<eval>", "exec"), names)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), "<eval>", "eval"), names)
    return None if value is None else repr(value)


class FakeDriver:
    """Stands where :class:`forkd.vmm.vm.VM`'s constructors stand; records every VM."""

    def __init__(self) -> None:
        self.vms: list[FakeVM] = []
        self.fail_restore: Exception | None = None
        self.boot_delay = 0.0
        self.restore_delay = 0.0  # a fork in flight this long, for admission races
        self.restore_kwargs: list[dict[str, Any]] = []  # what each restore was asked
        self.boot_kwargs: list[dict[str, Any]] = []  # ... and each boot

    async def boot(
        self,
        image: Any,
        *,
        run_root: Path,
        memory_mib: int = 256,
        vcpus: int = 1,
        vm_id: str | None = None,
        attach: Any = (),
        **kw: Any,
    ) -> FakeVM:
        self.boot_kwargs.append(kw)
        await asyncio.sleep(self.boot_delay)
        runtime = getattr(image, "runtime", None)  # a container image's disk, as VM.boot
        cmdline = f"{KERNEL_CMDLINE} {RUNTIME_CMDLINE}" if runtime else KERNEL_CMDLINE
        machine = MachineConfig(
            memory_mib,
            vcpus,
            "tcg",
            image.vmlinuz,
            image.initrd,
            image.rootfs,
            cmdline=cmdline,
            runtime=runtime,
        )
        vm = FakeVM(vm_id or f"vm-{len(self.vms)}", machine, run_root, GuestContents())
        vm.image_name = image.name
        vm.image_ref = ImageRef(image.name, image.key, str(image.dir))
        vm.volumes = list(attach)
        self.vms.append(vm)
        return vm

    async def spawn_incoming(
        self, snapshot_dir: Path, *, run_root: Path, vm_id: str | None = None, **kw: Any
    ) -> FakeVM:
        if self.fail_restore is not None:
            raise self.fail_restore
        files = snapshot_files.load(snapshot_dir)
        state = snapshot_dir / GUEST_STATE  # a pulled snapshot has none: an empty guest
        guest = (
            GuestContents.from_json(json.loads(state.read_text()))
            if state.exists()
            else GuestContents()
        )
        vm_id = vm_id or f"vm-{len(self.vms)}"
        vm = FakeVM(vm_id, files.machine, run_root, guest, state=VMState.INCOMING)
        if kw.get("egress_policy") is not None:  # as VM.spawn_incoming records it
            vm.set_egress(kw["egress_policy"])
        vm.origin, vm.origin_id = snapshot_dir, files.meta.id
        vm.volumes = list(files.meta.volumes)
        self.vms.append(vm)
        return vm

    async def restore(self, snapshot_dir: Path, *, seed: int | None = None, **kw: Any) -> FakeVM:
        self.restore_kwargs.append(kw)
        await asyncio.sleep(self.restore_delay)
        vm = await self.spawn_incoming(snapshot_dir, **kw)
        await vm.finish_restore(seed=seed)
        return vm

    async def adopt(self, run_dir: Path, paused: bool = False) -> FakeVM:
        raise VMError(f"no QEMU runs for {run_dir} (fake driver)")


if TYPE_CHECKING:  # mypy proves the fakes stand where VM and its constructors do
    from forkd.controller.services.launcher import VMDriver
    from forkd.controller.services.sandbox_vm import SandboxVM

    def _fake_vm_is_a_sandbox_vm(vm: FakeVM) -> SandboxVM:
        return vm

    def _fake_driver_is_a_vm_driver(driver: FakeDriver) -> VMDriver:
        return driver
