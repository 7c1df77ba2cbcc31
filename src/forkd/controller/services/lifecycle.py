"""The daemon's start and stop: reconcile the registry with the disk, re-adopt
live sandboxes, kill stray QEMU processes, and reap expired or dead sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

from forkd.controller.services.fleet import Fleet
from forkd.controller.services.snapshots import snapshot_row
from forkd.errors import SnapshotError
from forkd.limits import NAME_RE
from forkd.vmm import processes, snapshot_files

log = logging.getLogger(__name__)

REAP_INTERVAL_SECS = 1.0


class Lifecycle:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bring the registry in line with the disk and re-adopt live sandboxes."""
        self.reconcile_snapshots()
        await self.adopt_sandboxes()
        self.kill_strays()
        self._reaper = asyncio.create_task(self._reap_loop(), name="forkd-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        fleet = self.fleet
        await fleet.pool.close()
        if fleet.settings.kill_on_exit:
            await asyncio.gather(*(fleet.remove(sid) for sid in list(fleet.vms)))
        else:  # leave them running for the next daemon to adopt
            for vm in fleet.vms.values():
                await vm.release()
        fleet.vms.clear()

    # ------------------------------------------------------------ start

    def reconcile_snapshots(self) -> None:
        """Remove staging leftovers; register committed snapshots the registry lacks."""
        root = self.fleet.settings.snapshot_root
        for leftover in root.glob(".*.partial-*"):
            log.info("removing staging directory %s left by a crash", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        store = self.fleet.store
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

    async def adopt_sandboxes(self) -> None:
        fleet = self.fleet
        for row in fleet.store.list_sandboxes():
            if row.state == "dead":
                continue
            run_dir = Path(row.run_dir)
            try:
                vm = await fleet.driver.adopt(run_dir)
            except Exception as exc:  # one broken VM must not stop the daemon
                log.info("sandbox %s is gone (%s): removing it", row.id, exc)
                if row.pid and processes.qemu_pid_matches(row.pid, run_dir):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(row.pid, signal.SIGKILL)
                shutil.rmtree(run_dir, ignore_errors=True)
                fleet.store.delete_sandbox(row.id)
                continue
            fleet.vms[row.id] = vm
            fleet.store.update_sandbox(row.id, state="running", pid=vm.pid)
            log.info("re-adopted sandbox %s (pid %s)", row.id, vm.pid)

    def kill_strays(self) -> None:
        """QEMU processes and run directories of ours that no sandbox owns."""
        fleet = self.fleet
        ours = {str(vm.rt.dir) for vm in fleet.vms.values()}
        for pid, run_dir in processes.qemu_run_dirs(fleet.settings.run_dir).items():
            if str(run_dir) not in ours:
                log.warning("killing stray QEMU %s (%s)", pid, run_dir)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                shutil.rmtree(run_dir, ignore_errors=True)
        registered = {r.run_dir for r in fleet.store.list_sandboxes()}
        for d in fleet.settings.run_dir.iterdir():
            if d.is_dir() and str(d) not in ours and str(d) not in registered:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------ reaper

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECS)
            try:
                await self.reap_once()
            except Exception:  # keep reaping whatever one pass hit
                log.exception("reaper pass failed")

    async def reap_once(self) -> None:
        """Kill sandboxes past their timeout; mark those whose QEMU exited dead."""
        fleet = self.fleet
        t = time.time()
        for row in fleet.store.list_sandboxes():
            if row.state == "starting":
                continue  # its fork request owns it until it runs or fails
            if row.expires_at_unix is not None and row.expires_at_unix <= t:
                log.info("sandbox %s reached its timeout: killing it", row.id)
                await fleet.remove(row.id)
                continue
            vm = fleet.vms.get(row.id)
            if vm is not None and not vm.is_alive() and row.state != "dead":
                log.warning("sandbox %s died (QEMU exited)", row.id)
                await fleet.mark_dead(row.id)
