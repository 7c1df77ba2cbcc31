"""The daemon's start and stop: reconcile the registry with the disk, re-adopt
live sandboxes, kill stray QEMU processes, and reap expired or dead sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import shutil
import signal
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from forkd.controller.services.activity import Activity
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.services.launcher import Launcher
from forkd.controller.services.live_vms import LiveVMs, vm_id_prefixes
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.snapshots import snapshot_row
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.controller.store_rows import SandboxRow
from forkd.errors import SnapshotError
from forkd.guest import image_sharing
from forkd.image_import import leftovers
from forkd.limits import NAME_RE
from forkd.states import OnTimeout, SandboxState, SnapshotMode, SnapshotStatus
from forkd.vmm.jail import egress, network, qemu_user
from forkd.vmm.pool import ForkPool
from forkd.vmm.qemu import host_processes
from forkd.vmm.snapshot import files as snapshot_files

log = logging.getLogger(__name__)

STRAY_EXIT_SECS = 3.0  # for killed stray QEMUs to leave their cgroups

REAP_INTERVAL_SECS = 1.0
# One sandbox's check, killing it included (a kill is itself bounded: SIGKILL,
# limits.KILL_WAIT_SECS, channels closed without a flush); the next pass retries.
REAP_CHECK_SECS = 15.0
OUTPUT_ANSWER_SECS = 5.0  # for an idle sandbox's guest to list its processes
SILENT_CHECKS = 3  # unanswered listings in a row after which an idle sandbox is idle
EXPIRY_SECS = 600.0  # one sandbox's on_timeout, a branch of its whole memory included
PROBE_SECS = 5.0  # one VM.is_alive()
PROBE_THREADS = 4
STOP_VM_SECS = 15.0  # at daemon stop, killing or letting go of one VM

T = TypeVar("T")


class Expire(Protocol):
    """:meth:`forkd.controller.services.expiry.Expiry.expire`."""

    def __call__(self, row: SandboxRow, idle: bool = False) -> Awaitable[None]: ...


class Lifecycle:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        activity: Activity,
        hibernated: HibernatedFiles,
        vms: LiveVMs,
        pool: ForkPool[SandboxVM],
        launcher: Launcher,
        expire: Expire | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.activity = activity
        self.hibernated = hibernated
        self.vms = vms
        self.pool = pool
        self.launcher = launcher
        self._expire = expire  # a sandbox's on_timeout; None: kill it
        self._reaper: asyncio.Task[None] | None = None
        self._checks: dict[str, asyncio.Task[None]] = {}  # sandbox id -> its check in flight
        # sandbox id -> (the idle spell's start, its listings unanswered in a row)
        self._silent: dict[str, tuple[float, int]] = {}
        self._probes = Probes(PROBE_THREADS)

    async def start(self) -> None:
        """Bring the registry in line with the disk and re-adopt live sandboxes."""
        self.reconcile_snapshots()
        settings = self.settings
        await asyncio.to_thread(  # other daemons on this cache keep what our snapshots use
            image_sharing.record_daemon,
            settings.state_dir,
            [settings.snapshot_root, settings.run_dir],
        )
        swept = await asyncio.to_thread(leftovers.sweep)
        if swept.workers_killed or swept.removed:
            log.info(
                "an import left by a daemon that died: %d worker(s) killed, %d leftover(s) removed",
                swept.workers_killed,
                swept.removed,
            )
        await self.adopt_sandboxes()
        self.kill_strays()
        await asyncio.to_thread(self.remove_stray_networks)
        await self.remove_stray_cgroups()
        self._reaper = asyncio.create_task(self._reap_loop(), name="forkd-reaper")

    async def stop(self) -> None:
        """Stop reaping; kill or let go of every VM, each bounded by ``STOP_VM_SECS``."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._checks.values()):
            task.cancel()
        if self._checks:
            await asyncio.wait(list(self._checks.values()), timeout=STOP_VM_SECS)
        await _bounded("closing the fork pool", self.pool.close())
        if self.settings.kill_on_exit:
            stops = [
                _bounded(f"killing {sid}", self.vms.remove(sid, "daemon_shutdown"))
                for sid in list(self.vms)
            ]
        else:  # leave them running for the next daemon to adopt
            stops = [_bounded(f"letting go of {vm.id}", vm.release()) for vm in self.vms.values()]
        await asyncio.gather(*stops)
        self.vms.clear()
        self._probes.close()

    # ------------------------------------------------------------ start

    def reconcile_snapshots(self) -> None:
        """Remove staging leftovers; register committed snapshots the registry lacks."""
        root = self.settings.snapshot_root
        for leftover in root.glob(".*.partial-*"):
            log.info("removing %s left by a crash", leftover)
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:  # a pack or an archive on its way in
                leftover.unlink(missing_ok=True)
        store = self.store
        for row in store.list_snapshots():  # pending work survives no restart
            if row.status == SnapshotStatus.WRITING:
                log.info("branch %s was pending when the daemon stopped: failed", row.tag)
                shutil.rmtree(row.dir, ignore_errors=True)  # committed, maybe, never settled
                store.set_snapshot_status(
                    row.tag,
                    SnapshotStatus.FAILED,
                    error="the daemon stopped before the branch finished",
                )
        self._refresh_modes()
        kept = {r.id for r in store.list_sandboxes() if r.state != SandboxState.DEAD}
        for sid in self.hibernated.sleepers() - kept:
            log.info("removing the hibernated state of sandbox %s, which is gone", sid)
            self.hibernated.discard(sid)
        known = {row.tag for row in store.list_snapshots()}
        for d in sorted(root.iterdir()):
            if d.name.startswith(".") or d.name in known or not NAME_RE.fullmatch(d.name):
                continue
            if not (d / snapshot_files.META).is_file():
                continue
            try:
                files = snapshot_files.load(d)
            except SnapshotError as exc:
                log.warning("not registering %s: %s", d, exc)
                continue
            log.info("registering snapshot %s found on disk", d.name)
            with contextlib.suppress(sqlite3.IntegrityError):
                store.add_snapshot(snapshot_row(d.name, files))

    def _refresh_modes(self) -> None:
        """Each ready row's mode and base as its ``snapshot.json`` says: a crash between a
        compaction's swap and its registry update leaves the row saying diff."""
        store = self.store
        for row in store.list_snapshots():
            if row.status != SnapshotStatus.READY:
                continue
            try:
                meta = snapshot_files.load(Path(row.dir)).meta
            except SnapshotError:
                continue  # shown broken, as it is
            base_tag = meta.base.tag if meta.base else None
            if (row.mode, row.base_tag) != (meta.mode, base_tag):
                log.info("snapshot %s is %s on disk: registry updated", row.tag, meta.mode)
                store.update_snapshot(row.tag, mode=SnapshotMode(meta.mode), base_tag=base_tag)

    async def adopt_sandboxes(self) -> None:
        for row in self.store.list_sandboxes():
            if row.state == SandboxState.DEAD:
                continue
            if row.state == SandboxState.HIBERNATED:  # on disk, no QEMU: woken by resume
                if self.hibernated.latest(row.id) is None:
                    log.warning("hibernated sandbox %s lost its state: marked dead", row.id)
                    self.store.set_sandbox_state(row.id, SandboxState.DEAD)
                continue
            run_dir = Path(row.run_dir)
            paused = row.state == SandboxState.PAUSED  # adopted as the user left it
            try:
                vm = await self.launcher.driver.adopt(run_dir, paused=paused)
            except Exception as exc:  # one broken VM must not stop the daemon
                log.info("sandbox %s is gone (%s): removing it", row.id, exc)
                if row.pid and host_processes.qemu_pid_matches(row.pid, run_dir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(row.pid, signal.SIGKILL)
                shutil.rmtree(run_dir, ignore_errors=True)
                self.hibernated.discard(row.id)  # a woken one's state it no longer needs
                self.store.delete_sandbox(row.id)
                continue
            self.vms[row.id] = vm
            await self._listen(vm)
            if row.state == SandboxState.STARTING:  # died mid-fork, its QEMU running: it runs
                self.store.set_sandbox_state(row.id, SandboxState.RUNNING, pid=vm.pid)
            else:  # paused or running, as it was left
                self.store.update_sandbox(row.id, pid=vm.pid)
            log.info(
                "re-adopted sandbox %s (pid %s%s)", row.id, vm.pid, ", paused" if paused else ""
            )

    async def _listen(self, vm: SandboxVM) -> None:
        """The egress proxy in an adopted sandbox's namespace (the last daemon's went
        with it); a sandbox it cannot serve keeps running, its guest's TCP refused."""
        if vm.net is None:
            return
        policy = egress.of_machine(vm.machine.egress, vm.machine.internet)
        try:
            await network.listen(self.launcher.network, vm.net, vm.id, policy)
        except Exception as exc:
            log.warning(
                "sandbox %s: the egress proxy cannot listen in %s: %s", vm.id, vm.net.netns, exc
            )

    def kill_strays(self) -> None:
        """QEMU processes and run directories of ours that no sandbox owns.

        A process counts as ours only when it runs as this daemon's user or a
        uid of its QEMUs' range (:mod:`forkd.vmm.jail.qemu_user`) and its run
        directory, directly under ours, is named like one of our VMs' ids;
        what is deleted is a path we build, never one read from a process.
        """
        ours = {str(vm.rt.dir) for vm in self.vms.values()}
        mine = vm_id_prefixes(self.store.id_prefix)
        uids = qemu_user.qemu_uids()
        for pid, run_dir in host_processes.qemu_run_dirs(self.settings.run_dir).items():
            if str(run_dir) in ours or not run_dir.name.startswith(mine):
                continue
            if host_processes.owner_uid(pid) not in uids:
                continue
            log.warning("killing stray QEMU %s (%s)", pid, run_dir)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.settings.run_dir / run_dir.name, ignore_errors=True)
        registered = {r.run_dir for r in self.store.list_sandboxes()}
        for d in self.settings.run_dir.iterdir():
            if d.is_dir() and d.name.startswith(mine) and str(d) not in ours | registered:
                shutil.rmtree(d, ignore_errors=True)

    async def remove_stray_cgroups(self, wait_secs: float = STRAY_EXIT_SECS) -> None:
        """Groups of this daemon's VMs that no process uses: those of the strays and
        unadoptable sandboxes just killed, once their QEMUs have left them."""
        prefixes = vm_id_prefixes(self.store.id_prefix)
        live = {vm.rt.dir.name for vm in self.vms.values()}
        deadline = time.monotonic() + wait_secs
        while True:
            for name in await asyncio.to_thread(self.launcher.cgroups.remove_unused, prefixes):
                log.info("removed the cgroup of %s, whose QEMU is gone", name)
            left = [
                n
                for n in await asyncio.to_thread(self.launcher.cgroups.names, prefixes)
                if n not in live
            ]
            if not left or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.1)

    def remove_stray_networks(self) -> None:
        """Network namespaces of this daemon's VMs that no live VM uses (a crash's)."""
        if not self.launcher.network.enabled:
            return
        live = {vm.net.netns for vm in self.vms.values() if vm.net is not None}
        for name in network.remove_unused(vm_id_prefixes(self.store.id_prefix), live):
            log.warning("removed network namespace %s that no VM used", name)

    # ------------------------------------------------------------ reaper

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECS)
            try:
                self._start_checks()  # not awaited: a slow check holds up no later pass
            except Exception:  # keep reaping whatever one pass hit
                log.exception("reaper pass failed")

    async def reap_once(self) -> None:
        """One pass: kill sandboxes past their timeout, mark those whose QEMU exited dead.

        Each sandbox is checked in a task of its own, bounded by
        ``REAP_CHECK_SECS``: a VM whose check or kill hangs holds up no other.
        """
        started = self._start_checks()
        if started:
            await asyncio.wait(started)

    def _start_checks(self) -> list[asyncio.Task[None]]:
        started = []
        rows = self.store.list_sandboxes()
        listed = {row.id for row in rows}
        for gone in [sid for sid in self._silent if sid not in listed]:
            del self._silent[gone]
        for row in rows:
            if row.state == SandboxState.STARTING or row.id in self._checks:
                continue  # owned by its fork request, or still checked by an earlier pass
            task = asyncio.create_task(self._bounded_check(row), name=f"forkd-reap-{row.id}")
            self._checks[row.id] = task
            task.add_done_callback(functools.partial(self._checked, row.id))
            started.append(task)
        return started

    def _checked(self, sandbox_id: str, _: asyncio.Task[None]) -> None:
        self._checks.pop(sandbox_id, None)

    async def _bounded_check(self, row: SandboxRow) -> None:
        expired = row.expires_at_unix is not None and row.expires_at_unix <= time.time()
        expired = expired or self.activity.idle_expired(row)
        branching = (
            expired
            and row.on_timeout in (OnTimeout.BRANCH, OnTimeout.HIBERNATE)
            and row.state != SandboxState.DEAD
        )
        try:  # a branch at the timeout copies the sandbox's memory: it gets longer
            await asyncio.wait_for(self._check(row), EXPIRY_SECS if branching else REAP_CHECK_SECS)
        except TimeoutError:
            log.warning(
                "reaper: sandbox %s took over %g s; next pass retries", row.id, REAP_CHECK_SECS
            )
        except Exception:
            log.exception("reaper: checking sandbox %s failed", row.id)

    async def _idle_by_its_output(self, row: SandboxRow, vm: SandboxVM) -> bool:
        """Whether a sandbox idle by the API's clock also wrote nothing. A guest that
        does not answer once may just be loaded; one silent for ``SILENT_CHECKS`` checks
        in a row within one idle spell (use starts a new one) is idle, or wedged: it
        cannot outlive its idle timeout by never answering."""
        wrote = await self.vms.wrote_output(row.id, vm, OUTPUT_ANSWER_SECS)
        if wrote is not None:
            self._silent.pop(row.id, None)
            return not wrote
        spell = self.activity.idle_since(row)
        since, before = self._silent.get(row.id, (spell, 0))
        silent = (before if since == spell else 0) + 1
        self._silent[row.id] = (spell, silent)
        if silent < SILENT_CHECKS:
            log.info(
                "reaper: sandbox %s did not list its processes (%d of %d)",
                row.id,
                silent,
                SILENT_CHECKS,
            )
            return False
        log.warning(
            "reaper: sandbox %s did not answer %d checks in a row: taken as idle", row.id, silent
        )
        return True

    async def _check(self, row: SandboxRow) -> None:
        if row.expires_at_unix is not None and row.expires_at_unix <= time.time():
            if self._expire is not None:
                await self._expire(row)
            else:
                log.info("sandbox %s reached its timeout: killing it", row.id)
                await self.vms.remove(row.id, "timeout")
            return
        vm = self.vms.get(row.id)
        if vm is None or row.state == SandboxState.DEAD:
            return
        if (
            self._expire is not None
            and self.activity.idle_expired(row)
            and await self._idle_by_its_output(row, vm)
        ):
            self._silent.pop(row.id, None)
            await self._expire(row, idle=True)
            return
        try:
            alive = await self._probes.run(vm.is_alive, PROBE_SECS)
        except TimeoutError:
            log.warning("reaper: is_alive() of sandbox %s hung for %g s", row.id, PROBE_SECS)
            return
        if not alive:
            log.warning("sandbox %s died (QEMU exited)", row.id)
            await self.vms.mark_dead(row.id)


class Probes:
    """Runs blocking calls off the event loop, each awaited with a timeout.

    ``VM.is_alive`` reads ``/proc``, which can block on a process stuck in the
    kernel. Daemon threads of our own, not an executor's: a call that never
    returns must hold up neither the loop nor the daemon's exit.
    """

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._started: list[threading.Thread] = []

    async def run(self, call: Callable[[], T], timeout: float) -> T:
        """``call()`` in a probe thread; :class:`TimeoutError` after ``timeout`` s."""
        if not self._started:
            for i in range(self._threads):
                t = threading.Thread(target=self._work, name=f"forkd-probe-{i}", daemon=True)
                t.start()
                self._started.append(t)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put((call, loop, fut))
        return await asyncio.wait_for(fut, timeout)

    def close(self) -> None:
        for _ in self._started:
            self._queue.put(None)
        self._started.clear()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            call, loop, fut = job
            if fut.cancelled():  # timed out while queued behind a stuck call
                continue
            try:
                outcome: tuple[bool, Any] = (True, call())
            except BaseException as exc:  # handed to the awaiting task
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, fut, *outcome)


_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


async def _bounded(what: str, step: Awaitable[None]) -> None:
    """At stop: ``step`` within ``STOP_VM_SECS``; a failure is logged, the others go on."""
    try:
        await asyncio.wait_for(step, STOP_VM_SECS)
    except TimeoutError:
        log.error("%s took over %g s; left behind", what, STOP_VM_SECS)
    except Exception:
        log.exception("%s failed", what)
