"""Owns every VM and snapshot of one daemon: templates, forks, branches, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sqlite3
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkd.controller import validation
from forkd.controller.errors import ApiError, not_found
from forkd.controller.metrics import Metrics
from forkd.controller.store import SandboxRow, SnapshotRow, Store, now
from forkd.errors import AgentError, ForkdError, ImageError, SnapshotError, VMError
from forkd.guest import image as images
from forkd.vmm import live_snapshot, snapshot_files
from forkd.vmm.pool import ForkPool
from forkd.vmm.vm import VM, qemu_pid_matches
from forkd.vmm.volumes import (
    Attachment,
    VolumeError,
    VolumeStore,
    attach_for_boot,
    parse_size,
)

log = logging.getLogger(__name__)

FORK_PARALLELISM = 4  # restores in flight at once (each is a QEMU start)
SETUP_TIMEOUT_SECS = 900
REAP_INTERVAL_SECS = 1.0


@dataclass
class Settings:
    state_dir: Path
    snapshot_root: Path
    run_dir: Path
    branch_concurrency: int = 4
    accel: str | None = None
    kill_on_exit: bool = False
    pool_size: int = 2  # QEMU processes kept waiting per recently forked snapshot


def _agent_status(exc: AgentError) -> ApiError:
    status = {
        "FileNotFoundError": 404,
        "IsADirectoryError": 400,
        "NotADirectoryError": 400,
        "FileExistsError": 409,
        "ValueError": 400,
        "PermissionError": 403,
    }.get(exc.kind or "", 502)
    return ApiError(status, str(exc))


class Manager:
    def __init__(self, settings: Settings, store: Store, metrics: Metrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.vms: dict[str, VM] = {}
        self._tags_in_flight: set[str] = set()
        self._branches_in_flight = 0
        # One branch of a given sandbox at a time: a second one must not resume
        # the source while the first is still capturing it.
        self._branch_locks: dict[str, asyncio.Lock] = {}
        # Templates being built and forks in progress hold volume layers that
        # no registry entry names yet: no layer collection meanwhile.
        self._volume_ops = 0
        self._fork_slots = asyncio.Semaphore(FORK_PARALLELISM)
        self._reaper: asyncio.Task[None] | None = None
        self.pool = ForkPool(
            settings.run_dir,
            per_snapshot=settings.pool_size,
            detach=True,  # a pooled QEMU becomes a sandbox that outlives the daemon
            new_id=store.next_sandbox_id,
        )
        self.volumes = VolumeStore(settings.state_dir / "volumes")
        settings.snapshot_root.mkdir(parents=True, exist_ok=True)
        settings.run_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bring the registry in line with the disk and re-adopt live sandboxes."""
        self._reconcile_snapshots()
        await self._adopt_sandboxes()
        self._kill_strays()
        self._reaper = asyncio.create_task(self._reap_loop(), name="forkd-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.pool.close()
        if self.settings.kill_on_exit:
            await asyncio.gather(*(self._kill(sid) for sid in list(self.vms)))
        else:  # leave them running for the next daemon to adopt
            for vm in self.vms.values():
                await vm.agent.close()
                with contextlib.suppress(Exception):
                    await vm.qmp.disconnect()
        self.vms.clear()

    def _reconcile_snapshots(self) -> None:
        root = self.settings.snapshot_root
        for leftover in root.glob(".*.partial-*"):
            log.info("removing staging directory %s left by a crash", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        known = {row.tag for row in self.store.list_snapshots()}
        for d in sorted(root.iterdir()):
            if d.name.startswith(".") or d.name in known or not (d / snapshot_files.META).is_file():
                continue
            if not validation.TAG_RE.fullmatch(d.name):
                continue
            try:
                files = snapshot_files.load(d)
            except SnapshotError as exc:
                log.warning("not registering %s: %s", d, exc)
                continue
            meta = files.meta
            log.info("registering snapshot %s found on disk", d.name)
            with contextlib.suppress(sqlite3.IntegrityError):
                self.store.add_snapshot(
                    SnapshotRow(
                        tag=d.name,
                        dir=str(d),
                        created_at_unix=int(meta.get("created_at_unix", now())),
                        branched_from=meta.get("branched_from"),
                        pause_ms=meta.get("pause_ms") if meta.get("branched_from") else None,
                        parent_tag=meta.get("parent_tag"),
                        image=(meta.get("image") or {}).get("name"),
                        memory_mib=files.machine.memory_mib,
                        status="ready",
                    )
                )

    async def _adopt_sandboxes(self) -> None:
        for row in self.store.list_sandboxes():
            if row.state == "dead":
                continue
            run_dir = Path(row.run_dir)
            try:
                vm = await VM.adopt(run_dir)
            except Exception as exc:  # one broken VM must not stop the daemon
                log.info("sandbox %s is gone (%s): removing it", row.id, exc)
                if row.pid and qemu_pid_matches(row.pid, run_dir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(row.pid, signal.SIGKILL)
                shutil.rmtree(run_dir, ignore_errors=True)
                self.store.delete_sandbox(row.id)
                continue
            self.vms[row.id] = vm
            self.store.update_sandbox(row.id, state="running", pid=vm.pid)
            log.info("re-adopted sandbox %s (pid %s)", row.id, vm.pid)

    def _kill_strays(self) -> None:
        """QEMU processes with a run directory of ours that no sandbox owns."""
        ours = {str(vm.rt.dir) for vm in self.vms.values()}
        marker = b"unix:" + str(self.settings.run_dir).encode() + b"/"
        suffix = b"/qmp.sock,server=on,wait=off"
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                args = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if not args or not args[0].endswith(b"qemu-system-x86_64"):
                continue
            for arg in args:
                if arg.startswith(marker) and arg.endswith(suffix):
                    run_dir = arg[len(b"unix:") :].split(b"/qmp.sock")[0].decode()
                    if run_dir not in ours:
                        log.warning("killing stray QEMU %s (%s)", proc.name, run_dir)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(proc.name), signal.SIGKILL)
                        shutil.rmtree(run_dir, ignore_errors=True)
        for d in self.settings.run_dir.iterdir():
            if (
                d.is_dir()
                and str(d) not in ours
                and not any(r.run_dir == str(d) for r in self.store.list_sandboxes())
            ):
                shutil.rmtree(d, ignore_errors=True)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECS)
            try:
                await self._reap_once()
            except Exception:  # keep reaping whatever one pass hit
                log.exception("reaper pass failed")

    async def _reap_once(self) -> None:
        t = time.time()
        for row in self.store.list_sandboxes():
            if row.state == "starting":
                continue  # its fork request owns it until it runs or fails
            if row.expires_at_unix is not None and row.expires_at_unix <= t:
                log.info("sandbox %s reached its timeout: killing it", row.id)
                await self._kill(row.id)
                continue
            vm = self.vms.get(row.id)
            if vm is not None and not vm.is_alive() and row.state != "dead":
                log.warning("sandbox %s died (QEMU exited)", row.id)
                await self._mark_dead(row.id)

    # ------------------------------------------------------------ snapshots

    def _reserve_tag(self, tag: str) -> None:
        if tag in self._tags_in_flight:
            raise ApiError(409, f"a snapshot named {tag!r} is being created")
        if self.store.get_snapshot(tag) is not None or (self.settings.snapshot_root / tag).exists():
            raise ApiError(409, f"snapshot {tag!r} already exists")
        self._tags_in_flight.add(tag)

    def _resolve_image(self, body: dict[str, Any]) -> images.Image:
        kernel, rootfs = body.get("kernel"), body.get("rootfs")
        if kernel or rootfs:
            parents = {Path(p).parent for p in (kernel, rootfs) if p}
            try:
                if len(parents) != 1:
                    raise ImageError("they are in different directories")
                return images.find_image(str(next(iter(parents))))
            except ImageError as exc:
                raise ApiError(
                    400, "kernel/rootfs must name files of one forkd image directory "
                    f"({exc}); or pass 'image' (see 'forkd image ls')",
                ) from exc  # fmt: skip
        name = body.get("image") or images.DEFAULT_IMAGE
        try:
            return images.find_image(name)
        except ImageError as exc:
            raise ApiError(400, str(exc)) from exc

    async def create_snapshot(self, body: dict[str, Any]) -> dict[str, Any]:
        tag = validation.check_tag(body.get("tag"))
        img = self._resolve_image(body)
        # The image recipe's template settings come first; the request adds to them.
        defaults = img.meta.get("template") or {}
        setup = [*(defaults.get("setup") or []), *(body.get("setup") or [])]
        warmups = [w for w in (defaults.get("warmup"), body.get("warmup")) if w]
        self._reserve_tag(tag)
        template: VM | None = None
        attach: list[Attachment] = []
        self._volume_ops += 1
        try:
            for spec in body.get("volumes") or []:
                try:
                    attach.append(attach_for_boot(
                        self.volumes, spec["name"], spec["path"], bool(spec.get("readonly"))
                    ))  # fmt: skip
                except VolumeError as exc:
                    msg = str(exc)
                    status = 404 if "not found" in msg else 500 if "layer" in msg else 400
                    raise ApiError(status, msg) from exc
            template = await VM.boot(
                img,
                run_root=self.settings.run_dir,
                memory_mib=int(body.get("memory_mib") or defaults.get("memory_mib") or 512),
                vcpus=int(body.get("vcpus") or defaults.get("vcpus") or 1),
                accel_name=self.settings.accel,
                vm_id=f"tpl-{tag}-{os.urandom(2).hex()}",
                boot_timeout=float(body.get("boot_wait_secs") or 90),
                attach=attach,
            )
            attach = []  # the VM owns them now
            for cmd in setup:
                res = await template.exec(["/bin/sh", "-c", cmd], timeout=SETUP_TIMEOUT_SECS)
                if res["exit_code"] != 0:
                    tail = (res["stderr"] or res["stdout"]).strip()[-1500:]
                    raise ApiError(500, f"setup command {cmd!r} exited {res['exit_code']}: {tail}")
            for warmup in warmups:
                res = await template.eval(warmup, timeout=SETUP_TIMEOUT_SECS)
                if res.get("error"):
                    raise ApiError(500, f"warmup failed:\n{res['error']}")
            dest = self.settings.snapshot_root / tag
            started = time.monotonic()
            await template.snapshot(dest, {"tag": tag})
            self.metrics.snapshot_seconds.observe(time.monotonic() - started)
            self.store.add_snapshot(
                SnapshotRow(
                    tag=tag, dir=str(dest), created_at_unix=now(), branched_from=None,
                    pause_ms=None, parent_tag=None, image=img.name,
                    memory_mib=template.machine.memory_mib, status="ready",
                )
            )  # fmt: skip
        except (VMError, AgentError) as exc:
            raise ApiError(500, f"building snapshot {tag!r} failed: {exc}") from exc
        finally:
            self._volume_ops -= 1
            if self.store.get_snapshot(tag) is None:  # failed after the commit: no orphan
                shutil.rmtree(self.settings.snapshot_root / tag, ignore_errors=True)
            for att in attach:  # made, but the VM never took them
                if not att.readonly:
                    Path(att.chain[0]).unlink(missing_ok=True)
            self._tags_in_flight.discard(tag)
            if template is not None:
                await template.kill()
        return self.snapshot_info(tag)

    def _snapshot_row(self, tag: str) -> SnapshotRow:
        validation.check_tag(tag)
        row = self.store.get_snapshot(tag)
        if row is None:
            raise not_found(f"snapshot {tag!r}")
        return row

    def snapshot_info(self, tag: str, detailed: bool = False) -> dict[str, Any]:
        row = self._snapshot_row(tag)
        d = Path(row.dir)
        info: dict[str, Any] = {
            "tag": row.tag,
            "dir": row.dir,
            "vmstate": str(d / snapshot_files.VMSTATE),
            "memory": str(d / snapshot_files.MEMORY),
            "created_at_unix": row.created_at_unix,
        }
        if row.branched_from is not None:
            info["branched_from"] = row.branched_from
            info["pause_ms"] = row.pause_ms
        problem = self._unbootable_reason(row)
        info.update(
            status=row.status if problem is None else "broken",
            bootable=problem is None,
            memory_mib=row.memory_mib,
            image=row.image,
            parent_tag=row.parent_tag,
        )
        if detailed:
            mem, vms = d / snapshot_files.MEMORY, d / snapshot_files.VMSTATE
            mst = mem.stat() if mem.exists() else None
            ancestors = self._ancestors(row)
            info.update(
                memory_logical_bytes=mst.st_size if mst else 0,
                memory_physical_bytes=mst.st_blocks * 512 if mst else 0,
                vmstate_bytes=vms.stat().st_size if vms.exists() else 0,
                chain_depth=len(ancestors),
                ancestors=ancestors,
                dependents=[r.tag for r in self.store.list_snapshots() if r.parent_tag == tag],
                sandboxes=[r.id for r in self.store.list_sandboxes() if r.snapshot_tag == tag],
            )
            if problem:
                info["problem"] = problem
        return info

    def _ancestors(self, row: SnapshotRow) -> list[str]:
        out: list[str] = []
        parent = row.parent_tag
        while parent and parent not in out:
            out.append(parent)
            prow = self.store.get_snapshot(parent)
            parent = prow.parent_tag if prow else None
        return out

    def _unbootable_reason(self, row: SnapshotRow) -> str | None:
        try:
            snapshot_files.load(Path(row.dir))
        except SnapshotError as exc:
            return str(exc)
        return None

    def list_snapshots(self) -> list[dict[str, Any]]:
        return [self.snapshot_info(r.tag) for r in self.store.list_snapshots()]

    async def delete_snapshot(self, tag: str) -> None:
        row = self._snapshot_row(tag)
        d = Path(row.dir)
        await self.pool.drop(d)
        # Out of the way first (a crash leaves a staging name that start-up
        # removes), then unregistered, then deleted. Running children keep
        # their mapping of memory.bin; only the directory entry goes.
        trash = d.parent / f".{d.name}.partial-del-{os.urandom(3).hex()}"
        with contextlib.suppress(FileNotFoundError):
            d.rename(trash)
        self.store.delete_snapshot(tag)
        await asyncio.to_thread(shutil.rmtree, trash, True)
        self._collect_layers()

    # ------------------------------------------------------------ sandboxes

    async def spawn(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        tag = validation.check_tag(body.get("snapshot_tag"))
        n = body.get("n", 1)
        row = self._snapshot_row(tag)
        problem = self._unbootable_reason(row)
        if problem is not None:
            raise ApiError(409, f"snapshot {tag!r} is not bootable: {problem}")
        if body.get("per_child_netns"):
            raise ApiError(
                400, "per_child_netns is not supported: every sandbox already has its own "
                "user-mode NAT",
            )  # fmt: skip
        timeout = body.get("timeout_secs")
        snap_dir = Path(row.dir)
        pooled: list[VM] = []
        if body.get("internet") is None:
            while len(pooled) < n and (vm := self.pool.take(snap_dir)) is not None:
                pooled.append(vm)
        ids = [vm.id for vm in pooled]
        ids += [self.store.next_sandbox_id() for _ in range(n - len(pooled))]
        waiting = {vm.id: vm for vm in pooled}

        async def one(sid: str) -> None:
            run_dir = self.settings.run_dir / sid
            self.store.add_sandbox(
                SandboxRow(
                    id=sid, snapshot_tag=tag, run_dir=str(run_dir), pid=None,
                    created_at_unix=now(), memory_limit_mib=body.get("memory_limit_mib"),
                    expires_at_unix=time.time() + timeout if timeout else None,
                    state="starting",
                )
            )  # fmt: skip
            async with self._fork_slots:
                vm = waiting.pop(sid, None)
                if vm is not None:
                    await vm.finish_restore()
                else:
                    vm = await VM.restore(
                        snap_dir,
                        run_root=self.settings.run_dir,
                        vm_id=sid,
                        detach=True,
                        internet=body.get("internet"),
                    )
            self.vms[sid] = vm
            self.store.update_sandbox(
                sid, pid=vm.pid, state="running", fork_ms=round(vm.ready_ms or 0, 1)
            )
            self.metrics.fork_seconds.observe((vm.ready_ms or 0) / 1000)

        self._volume_ops += 1
        try:
            results = await asyncio.gather(*(one(sid) for sid in ids), return_exceptions=True)
        finally:
            self._volume_ops -= 1
        if self.store.get_snapshot(tag) is not None:  # not deleted meanwhile
            self.pool.refill(snap_dir)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for vm in waiting.values():
                await vm.kill()
            await asyncio.gather(*(self._kill(sid) for sid in ids), return_exceptions=True)
            for sid in ids:
                self.store.delete_sandbox(sid)
            first = failures[0]
            if isinstance(first, ApiError):
                raise first
            raise ApiError(
                500, f"forking {n} from {tag!r} failed, none were kept: {first}"
            ) from first
        return [self.sandbox_info(sid) for sid in ids]

    def _sandbox_row(self, sandbox_id: str) -> SandboxRow:
        row = self.store.get_sandbox(sandbox_id)
        if row is None:
            raise not_found(f"sandbox {sandbox_id!r}")
        return row

    def sandbox_info(self, sandbox_id: str) -> dict[str, Any]:
        row = self._sandbox_row(sandbox_id)
        return {
            "id": row.id,
            "snapshot_tag": row.snapshot_tag,
            "netns": None,
            "guest_addr": None,
            "created_at_unix": row.created_at_unix,
            "pid": row.pid,
            "memory_limit_mib": row.memory_limit_mib,
            "state": row.state,
            "expires_at_unix": row.expires_at_unix,
            "fork_ms": row.fork_ms,
        }

    def list_sandboxes(self) -> list[dict[str, Any]]:
        return [self.sandbox_info(r.id) for r in self.store.list_sandboxes()]

    def _live(self, sandbox_id: str) -> VM:
        row = self._sandbox_row(sandbox_id)
        vm = self.vms.get(sandbox_id)
        if vm is None or row.state == "dead":
            raise ApiError(409, f"sandbox {sandbox_id!r} is {row.state}, not running")
        if not vm.is_alive():
            raise ApiError(409, f"sandbox {sandbox_id!r} is dead (its QEMU exited)")
        return vm

    async def _answers(self, vm: VM) -> bool:
        """Whether a VM whose QEMU may just have died still runs and answers."""
        try:
            await asyncio.wait_for(vm.ping(), 3.0)
        except (ForkdError, TimeoutError):
            return False
        return vm.is_alive()

    async def _mark_dead(self, sandbox_id: str) -> None:
        self._branch_locks.pop(sandbox_id, None)
        vm = self.vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        if self.store.get_sandbox(sandbox_id) is not None:
            self.store.update_sandbox(sandbox_id, state="dead")

    async def _kill(self, sandbox_id: str) -> None:
        self._branch_locks.pop(sandbox_id, None)
        vm = self.vms.pop(sandbox_id, None)
        if vm is not None:
            await vm.kill()
        else:
            row = self.store.get_sandbox(sandbox_id)
            if row is not None:
                shutil.rmtree(row.run_dir, ignore_errors=True)
        self.store.delete_sandbox(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        if self._sandbox_row(sandbox_id).state == "starting":
            raise ApiError(409, f"sandbox {sandbox_id!r} is still starting; retry shortly")
        await self._kill(sandbox_id)

    async def _agent(self, sandbox_id: str, coro_fn: Any, *args: Any, **kw: Any) -> Any:
        vm = self._live(sandbox_id)
        try:
            return await coro_fn(vm, *args, **kw)
        except AgentError as exc:
            if not vm.is_alive():
                await self._mark_dead(sandbox_id)
                raise ApiError(409, f"sandbox {sandbox_id!r} died: {exc}") from exc
            raise _agent_status(exc) from exc

    async def ping(self, sandbox_id: str) -> dict[str, Any]:
        res = await self._agent(sandbox_id, VM.ping)
        return {**res, "pong": True}

    async def exec(self, sandbox_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._agent(
            sandbox_id, VM.exec, body["args"], timeout=float(body.get("timeout_secs") or 30),
            cwd=body.get("cwd"), env=body.get("env") or None, stdin=body.get("stdin"),
        )  # fmt: skip

    async def eval(self, sandbox_id: str, code: str) -> dict[str, Any]:
        return await self._agent(sandbox_id, VM.eval, code)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._agent(sandbox_id, VM.read_file, validation.check_guest_path(path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> int:
        return await self._agent(sandbox_id, VM.write_file, validation.check_guest_path(path), data)

    async def list_files(self, sandbox_id: str, path: str) -> list[dict[str, Any]]:
        return await self._agent(sandbox_id, VM.list_dir, validation.check_guest_path(path))

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._agent(sandbox_id, VM.remove, validation.check_guest_path(path), recursive)

    # ------------------------------------------------------------ branching

    async def branch(self, sandbox_id: str, tag: str | None, mode: str | None) -> dict[str, Any]:
        if mode not in (None, "full"):
            raise ApiError(400, f"branch mode {mode!r} is not supported (only 'full')")
        if tag is not None:
            validation.check_tag(tag)
        vm = self._live(sandbox_id)
        row = self._sandbox_row(sandbox_id)
        if self._branches_in_flight >= self.settings.branch_concurrency:
            raise ApiError(
                503, f"{self._branches_in_flight} branches are in flight "
                f"(the cap is {self.settings.branch_concurrency}); retry shortly",
            )  # fmt: skip
        if tag is None:
            tag = f"branch-{sandbox_id}-{self.store.next_branch_seq(sandbox_id)}"
            validation.check_tag(tag)
        self._reserve_tag(tag)
        self._branches_in_flight += 1
        lock = self._branch_locks.setdefault(sandbox_id, asyncio.Lock())
        try:
            async with lock:
                return await self._branch_locked(vm, row, sandbox_id, tag)
        finally:
            self._branches_in_flight -= 1
            self._tags_in_flight.discard(tag)

    async def _branch_locked(
        self, vm: VM, row: SandboxRow, sandbox_id: str, tag: str
    ) -> dict[str, Any]:
        if not vm.is_alive() or self.vms.get(sandbox_id) is not vm:
            raise ApiError(409, f"sandbox {sandbox_id!r} stopped running")
        # The source's volume settings carry over to the branch unchanged: the
        # VM records them (with the layer chain frozen at the pause).
        meta = {"tag": tag, "branched_from": sandbox_id, "parent_tag": row.snapshot_tag}
        dest = self.settings.snapshot_root / tag
        try:
            result = await live_snapshot.snapshot_running(vm, dest, meta)
        except live_snapshot.LiveSnapshotError as exc:
            if exc.snapshot_kept:
                self._register_branch(tag, dest, sandbox_id, row, None)
            if not exc.source_alive or not await self._answers(vm):
                await self._mark_dead(sandbox_id)
            raise ApiError(500, f"branch of {sandbox_id} failed: {exc}") from exc
        self._register_branch(tag, result.dir, sandbox_id, row, result.pause_ms)
        self.metrics.branch_pause_seconds.observe(result.pause_ms / 1000)
        return self.snapshot_info(tag)

    def _register_branch(
        self, tag: str, d: Path, source: str, row: SandboxRow, pause_ms: float | None
    ) -> None:
        files = snapshot_files.load(d)
        if pause_ms is None:
            pause_ms = files.meta.get("pause_ms")
        self.store.add_snapshot(
            SnapshotRow(
                tag=tag, dir=str(d), created_at_unix=now(), branched_from=source,
                pause_ms=pause_ms, parent_tag=row.snapshot_tag,
                image=(files.meta.get("image") or {}).get("name"),
                memory_mib=files.machine.memory_mib, status="ready",
            )
        )  # fmt: skip

    # -------------------------------------------------------------- volumes

    def _snapshot_volumes(self) -> dict[str, list[dict[str, Any]]]:
        """The volumes each snapshot directory on disk records, by directory name."""
        found: dict[str, list[dict[str, Any]]] = {}
        for d in self.settings.snapshot_root.iterdir():
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((d / snapshot_files.META).read_text())
                found[d.name] = list(meta.get("volumes") or [])
        return found

    def _volume_users(
        self, name: str, recorded: dict[str, list[dict[str, Any]]] | None = None
    ) -> list[str]:
        recorded = self._snapshot_volumes() if recorded is None else recorded
        users = [
            f"snapshot {row.tag}"
            for row in self.store.list_snapshots()
            if any(v.get("name") == name for v in recorded.get(Path(row.dir).name, []))
        ]
        for sid, vm in self.vms.items():
            if any(v.name == name for v in vm.volumes):
                users.append(f"sandbox {sid}")
        return users

    def _collect_layers(self) -> None:
        """Delete volume layers that no snapshot and no VM (or pooled QEMU) uses."""
        if self._volume_ops or self.pool.filling():
            return  # layers of work in progress are not registered yet; next time
        in_use: set[str] = set()
        for recorded in self._snapshot_volumes().values():
            for v in recorded:
                in_use.update(v.get("chain") or [])
        for vm in [*self.vms.values(), *self.pool.all_vms()]:
            for att in vm.volumes:
                in_use.update(att.chain)
        removed = self.volumes.collect(in_use)
        if removed:
            log.info("removed %d volume layers no snapshot or sandbox uses", removed)

    def list_volumes(self) -> list[dict[str, Any]]:
        recorded = self._snapshot_volumes()  # read once for every volume
        return [
            {**v, "used_by": self._volume_users(v["name"], recorded)} for v in self.volumes.list()
        ]

    def volume_info(self, name: str) -> dict[str, Any]:
        try:
            return {**self.volumes.get(name), "used_by": self._volume_users(name)}
        except VolumeError as exc:
            raise ApiError(404 if "not found" in str(exc) else 400, str(exc)) from exc

    async def create_volume(self, name: str, size: str, content: bytes) -> dict[str, Any]:
        try:
            nbytes = parse_size(size)
            if self.volumes.exists(name):
                raise ApiError(409, f"volume {name!r} already exists")
            tar_path: Path | None = None
            if content:
                fd, tmp = tempfile.mkstemp(dir=self.volumes.root, prefix=".upload-")
                with os.fdopen(fd, "wb") as f:
                    f.write(content)
                tar_path = Path(tmp)
            try:
                info = await asyncio.to_thread(self.volumes.create, name, nbytes, tar_path)
            finally:
                if tar_path is not None:
                    tar_path.unlink(missing_ok=True)
        except (VolumeError, ForkdError) as exc:
            raise ApiError(400, str(exc)) from exc
        except tarfile.TarError as exc:
            raise ApiError(400, f"the upload is not a usable tar archive: {exc}") from exc
        return {**info, "used_by": []}

    async def delete_volume(self, name: str) -> None:
        self.volume_info(name)  # 404 / 400 first
        users = self._volume_users(name)
        if self._volume_ops:
            users.append("a template build or fork in progress")
        if users:
            raise ApiError(409, f"volume {name!r} is in use by {', '.join(users)}")
        await self.pool.drop_using(name)
        self.volumes.remove(name)
