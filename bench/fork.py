"""Fork benchmark: cold boot vs. fork from a snapshot, child memory, snapshot pause.

Run from the repository root::

    python bench/fork.py                 # table on stdout, then one JSON line
    python bench/fork.py --json-only     # only the JSON line

Phases (every VM is killed and the work directory removed at the end, also on
failure or Ctrl-C):

1. boot a template (``cold_boot_ms``), warm it (``x = 41``, a file), snapshot it;
2. fork ``--forks`` children one after another, all kept alive; per-child
   ``ready_ms`` gives p50/p90, and after ~1 s idle each child's host memory is
   read from smaps_rollup (private / rss / pss);
3. fork ``--concurrent`` children at once (``fork10_concurrent_wall_ms``);
4. plain QEMU save/restore, what a QEMU user would do instead of a fork
   (bench/qemu_baseline.py): a second template, booted and warmed the same way,
   ``--baseline-runs`` times ``stop`` + ``migrate`` (RAM included) to a file
   (``qemu_save_ms``, ``qemu_save_file_mib``), then a new QEMU restoring it with
   ``-incoming`` + ``cont`` until the agent answers (``qemu_restore_ms``); beside
   forkd's snapshot disk (``forkd_snapshot_disk_mib``: memory.bin + vmstate
   allocated) and ``fork_vs_qemu_restore_ratio`` (restore p50 / fork p50);
5. for each ``--pause-sizes`` size: boot a template of that size, dirty 8 MiB
   in the guest and time the pause window (pause -> capture -> resume) of 3
   snapshots; the median is ``snapshot_pause_ms[size]``.

The last line of stdout is always one JSON object (also when a phase failed:
then it carries ``"error"`` and the process exits non-zero).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd.guest import image as guest_image
from forkd.states import VMState
from forkd.vmm.pool import ForkPool
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.vm import VM

# These scripts run as `python bench/<name>.py`; the shared helpers live next to
# them in bench/benchlib.py, which is not an installed package. Put this file's
# folder first on sys.path so `import benchlib` works from any cwd (Python does
# that for a script already, but not under -P / PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
import qemu_baseline
from benchlib import MIB, allocated_mib, judge, percentile, r1

DIRTY_MIB = 8
PAUSE_SNAPSHOTS = 3
IDLE_BEFORE_MEMORY_S = 1.0

TARGETS = {
    # name: (metric key, comparison, bound)
    "fork_p50_ms": ("fork_p50_ms", "<=", 120.0),  # a pool miss: QEMU started for the fork
    "fork_pool_hit_p50_ms": ("fork_pool_hit_p50_ms", "<=", 30.0),  # a warm pooled QEMU
    "fork_vs_boot_ratio": ("fork_vs_boot_ratio", ">=", 20.0),
    "fork10_concurrent_wall_ms": ("fork10_concurrent_wall_ms", "<=", 1500.0),
    "snapshot_pause_ms_256": ("snapshot_pause_ms.256", "<=", 300.0),
}


# ------------------------------------------------------------------ helpers

parse_sizes = benchlib.sizes_parser("--pause-sizes")


class Bench(benchlib.BenchBase):
    """The fork benchmark's phases (VM bookkeeping: BenchBase)."""

    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        # self.rows (from BenchBase): (label, value, target) detail rows for the main table
        self.pause_rows: list[tuple[str, ...]] = []

    # -------------------------------------------------------------- plumbing

    async def timed_snapshot(self, vm: VM, dest: Path) -> dict[str, Any]:
        """Snapshot with the step API; returns the pause window and the driver's stats."""
        writer = await vm.begin_snapshot(dest)
        paused = False
        try:
            t0 = time.monotonic()
            await vm.pause()
            paused = True
            await writer.capture()
            await vm.resume()
            paused = False
            pause_ms = (time.monotonic() - t0) * 1000
        except BaseException:
            await writer.abort()
            if paused and vm.is_alive():
                with contextlib.suppress(Exception):
                    await vm.resume()
            raise
        meta = await writer.commit()
        return {
            "pause_ms": pause_ms,
            "capture_ms": writer.capture_ms,
            "meta": meta,
            "memory_bin_mib": allocated_mib(dest / "memory.bin"),
            "pages_written": writer.stats.pages_written,
        }

    # ---------------------------------------------------------------- phases

    async def _warm_template(self, image: guest_image.Image) -> VM:
        """A booted template of ``--memory`` MiB, warmed: ``x = 41`` and a file."""
        tpl = await self._boot(image, self.args.memory)
        try:
            out = await tpl.guest.eval("x = 41")
            if out.get("error"):
                raise RuntimeError(f"warm-up eval failed: {out['error']}")
            await tpl.guest.write_file("/tmp/forkd-bench.txt", b"warm\n")
        except BaseException:
            await self._kill([tpl])
            raise
        return tpl

    async def phase_template(self, image: guest_image.Image) -> Path:
        mem = self.args.memory
        self.say.log(f"booting a {mem} MiB template (cold boot)")
        tpl = await self._warm_template(image)
        self.results["cold_boot_ms"] = r1(tpl.ready_ms)
        snap = self._new_snap_dir(f"template-{mem}")
        snap_info = await self.timed_snapshot(tpl, snap)
        self.results["accel"] = snap_info["meta"].machine.accel
        self.results["template_snapshot_pause_ms"] = r1(snap_info["pause_ms"])
        self.results["template_memory_bin_mib"] = r1(snap_info["memory_bin_mib"])
        # What a fork needs on disk (snapshot.json aside): to set beside QEMU's save file.
        disk = allocated_mib(snap / snapshot_files.MEMORY) + allocated_mib(
            snap / snapshot_files.VMSTATE
        )
        self.results["forkd_snapshot_disk_mib"] = r1(disk)
        self.rows.append(("template snapshot pause", f"{snap_info['pause_ms']:.1f} ms", ""))
        self.rows.append(
            ("template memory.bin allocated", f"{snap_info['memory_bin_mib']:.1f} MiB", "")
        )
        # Children map memory.bin, not the template: it can go.
        await self._kill([tpl])
        return snap

    async def phase_sequential(self, snap: Path) -> None:
        n = self.args.forks
        self.say.log(f"forking {n} children one after another")
        children: list[VM] = []
        try:
            for _ in range(n):
                children.append(await self._fork(snap))
            ready = [c.ready_ms or 0.0 for c in children]
            await asyncio.sleep(IDLE_BEFORE_MEMORY_S)
            usage = [c.memory_usage() for c in children]
            first_exec = [await self._first_exec_ms(c) for c in children]  # after: it grows them
            # Check the children really are the warm template (after reading memory).
            checks = await asyncio.gather(*(c.guest.eval("x + 1") for c in children))
            bad = [c.id for c, out in zip(children, checks, strict=True) if out["result"] != "42"]
            if bad:
                raise RuntimeError(f"children {bad} did not see the template's x = 41")
            content = await children[0].guest.read_file("/tmp/forkd-bench.txt")
            if content != b"warm\n":
                raise RuntimeError(f"a child read {content!r} from the template's file")
        finally:
            await self._kill(children)
        res = self.results
        res["first_exec_after_miss_ms_p50"] = r1(percentile(first_exec, 50))
        res["fork_ms"] = [r1(x) for x in ready]
        res["fork_first_ms"] = r1(ready[0])
        res["fork_p50_ms"] = r1(percentile(ready, 50))
        res["fork_p90_ms"] = r1(percentile(ready, 90))
        res["fork_max_ms"] = r1(max(ready))
        for key in ("private", "rss", "pss"):
            vals = [u.get(key, 0) / MIB for u in usage]
            res[f"child_{key}_mib_p50"] = r1(percentile(vals, 50))
            res[f"child_{key}_mib_max"] = r1(max(vals))
        res["children_pss_total_mib"] = r1(sum(u.get("pss", 0) for u in usage) / MIB)

    async def phase_pooled(self, snap: Path, warm: bool) -> None:
        """Forks that take a QEMU started ahead of time: ``warm`` (what the daemon does)
        restored and stopped, claimed with ``cont`` and one agent call; else only
        started, waiting for the snapshot's state."""
        n = self.args.forks
        kind = "warm" if warm else "pre-started"
        self.say.log(f"forking {n} children through a pool of {kind} QEMUs")
        pool = ForkPool(self.run_root, spawn=VM.spawn_incoming, per_snapshot=1, warm=warm)
        children: list[VM] = []
        try:
            for _ in range(n):
                pool.refill(snap)
                await pool.wait_filled(snap)  # steady state: one is waiting
                vm = pool.take(snap)
                if vm is None:
                    raise RuntimeError("the pool had no QEMU waiting")
                children.append(vm)
                await (vm.claim() if warm else vm.finish_restore())
            first_exec = [await self._first_exec_ms(c) for c in children]
            checks = await asyncio.gather(*(c.guest.eval("x + 1") for c in children))
            if any(out["result"] != "42" for out in checks):
                raise RuntimeError("a pooled child did not see the template's x = 41")
            ready = [c.ready_ms or 0.0 for c in children]
        finally:
            await pool.close()
            await self._kill(children)
        key = "fork_pool_hit" if warm else "fork_pooled"
        self.results[f"first_exec_after_{'pool_hit' if warm else 'pooled'}_ms_p50"] = r1(
            percentile(first_exec, 50)
        )
        self.results[f"{key}_ms"] = [r1(x) for x in ready]
        self.results[f"{key}_p50_ms"] = r1(percentile(ready, 50))
        self.results[f"{key}_p90_ms"] = r1(percentile(ready, 90))

    @staticmethod
    async def _first_exec_ms(vm: VM) -> float:
        """How long a child's first command (``true``) takes, through the agent."""
        t0 = time.monotonic()
        out = await vm.guest.exec(["true"])
        if out.get("exit_code") != 0:
            raise RuntimeError(f"`true` failed in {vm.id}: {out}")
        return (time.monotonic() - t0) * 1000

    async def phase_concurrent(self, snap: Path) -> None:
        n = self.args.concurrent
        self.say.log(f"forking {n} children at once")
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(self._fork(snap) for _ in range(n)), return_exceptions=True
        )
        wall = (time.monotonic() - t0) * 1000
        children = [o for o in outcomes if isinstance(o, VM)]
        try:
            for o in outcomes:
                if isinstance(o, BaseException):
                    raise o
            ready = [c.ready_ms or 0.0 for c in children]
        finally:
            await self._kill(children)
        self.results["fork10_concurrent_wall_ms"] = r1(wall)
        self.results["concurrent_forks"] = n
        self.results["concurrent_child_ready_p50_ms"] = r1(percentile(ready, 50))
        self.results["concurrent_child_ready_max_ms"] = r1(max(ready))

    async def _qemu_restore(self, tpl: VM, src: Path) -> float:
        """One plain-QEMU restore of ``src``: ms from the process start to the agent's
        answer; the restored guest must hold the template's ``x``. Killed after."""
        started = time.monotonic()
        vm = await qemu_baseline.start_incoming(tpl.machine, self.run_root)
        self.vms.append(vm)  # no await since start_incoming returned: never lost
        try:
            await qemu_baseline.restore_from_file(vm, src)
            ms = (time.monotonic() - started) * 1000
            out = await vm.guest.eval("x + 1")
            if out.get("result") != "42":
                raise RuntimeError(f"the QEMU-restored guest did not see x = 41: {out}")
        finally:
            await self._kill([vm])
        return ms

    async def phase_qemu_baseline(self, image: guest_image.Image) -> None:
        """What a QEMU user would do instead of a fork: save to a file, restore it."""
        runs = self.args.baseline_runs
        self.say.log(f"plain QEMU save/restore: {runs} runs from a warm {self.args.memory} MiB VM")
        saves: list[float] = []
        restores: list[float] = []
        sizes: list[float] = []
        tpl = await self._warm_template(image)
        try:
            for i in range(runs):
                dest = self.workdir / f"qemu-save-{i}.bin"
                try:
                    saves.append(await qemu_baseline.save_to_file(tpl, dest))
                    sizes.append(dest.stat().st_size / MIB)
                    restores.append(await self._qemu_restore(tpl, dest))
                finally:
                    dest.unlink(missing_ok=True)
                if i + 1 < runs:  # the template runs again before the next save
                    await tpl.qmp.execute("cont")
                    tpl._set_state(VMState.RUNNING)
        finally:
            await self._kill([tpl])
        res = self.results
        res["qemu_baseline_runs"] = runs
        res["qemu_save_ms_all"] = [r1(x) for x in saves]
        res["qemu_restore_ms_all"] = [r1(x) for x in restores]
        res["qemu_save_ms"] = r1(statistics.median(saves))
        res["qemu_restore_ms"] = r1(statistics.median(restores))
        res["qemu_save_file_mib"] = r1(statistics.median(sizes))
        self.say.log(
            f"QEMU save file {res['qemu_save_file_mib']} MiB; forkd's template memory.bin "
            f"{res.get('template_memory_bin_mib')} MiB allocated (the guest's written pages)"
        )

    async def _pause_one(self, image: guest_image.Image, size: int) -> list[dict[str, Any]]:
        vm = await self._boot(image, size)
        snaps: list[Path] = []
        try:
            out = await vm.guest.eval(
                f"import os\nblob = bytearray({DIRTY_MIB} << 20)\n"
                f"blob[:] = os.urandom({DIRTY_MIB} << 20)\nlen(blob)"
            )
            if out.get("error"):
                raise RuntimeError(f"dirtying eval failed: {out['error']}")
            infos = []
            for _ in range(PAUSE_SNAPSHOTS):
                dest = self._new_snap_dir(f"pause-{size}")
                snaps.append(dest)
                infos.append(await self.timed_snapshot(vm, dest))
            return infos
        finally:
            await self._kill([vm])
            for d in snaps:
                shutil.rmtree(d, ignore_errors=True)

    async def phase_pause(self, image: guest_image.Image) -> None:
        # Filled in as sizes finish, so a later failure keeps the earlier figures.
        pause: dict[str, float | None] = self.results.setdefault("snapshot_pause_ms", {})
        mem_bin: dict[str, float | None] = self.results.setdefault("snapshot_memory_bin_mib", {})
        for size in self.args.pause_sizes:
            self.say.log(f"pause window: {size} MiB template, {DIRTY_MIB} MiB dirtied")
            try:
                infos = await self._pause_one(image, size)
            except Exception as exc:  # one size failing must not hide the others
                self.fail(f"pause window at {size} MiB", exc)
                pause[str(size)] = mem_bin[str(size)] = None
                continue
            windows = [i["pause_ms"] for i in infos]
            captures = [i["capture_ms"] or 0.0 for i in infos]
            mib = statistics.median(i["memory_bin_mib"] for i in infos)
            pages = statistics.median(i["pages_written"] for i in infos)
            pause[str(size)] = r1(statistics.median(windows))
            mem_bin[str(size)] = r1(mib)
            self.pause_rows.append(
                (
                    str(size),
                    ", ".join(f"{w:.0f}" for w in windows),
                    f"{statistics.median(windows):.1f}",
                    f"{statistics.median(captures):.1f}",
                    f"{mib:.1f}",
                    f"{int(pages)}",
                )
            )

    async def run(self) -> None:
        image = await self.python_image()
        snap = await self.phase_template(image)
        await self.phase_sequential(snap)
        await self.phase_pooled(snap, warm=False)
        await self.phase_pooled(snap, warm=True)
        await self.phase_concurrent(snap)
        if self.args.baseline_runs:
            try:  # a failure here must not hide the pause windows
                await self.phase_qemu_baseline(image)
            except Exception as exc:
                self.fail("plain QEMU save/restore", exc)
        await self.phase_pause(image)


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cold, p50 = results.get("cold_boot_ms"), results.get("fork_p50_ms")
    results["fork_vs_boot_ratio"] = round(cold / p50, 1) if cold and p50 else None
    qemu = results.get("qemu_restore_ms")
    hit = results.get("fork_pool_hit_p50_ms")
    # How many times faster than a plain QEMU restore a fork (a pool hit) is.
    results["fork_vs_qemu_restore_ratio"] = round(qemu / p50, 1) if qemu and p50 else None
    results["pool_hit_vs_qemu_restore_ratio"] = round(qemu / hit, 1) if qemu and hit else None
    results["memory_mib"] = args.memory
    results["host_cores"] = os.cpu_count()
    results["host_cores_usable"] = len(os.sched_getaffinity(0))
    targets = judge(results, TARGETS)
    results["targets"] = targets
    results["all_targets_met"] = all(t["met"] for t in targets.values())
    return results


def render(out: Console, bench: Bench, results: dict[str, Any]) -> None:
    res = results
    main = Table(title=f"forkd fork benchmark ({res.get('accel')}, {res['host_cores']} cores)")
    main.add_column("metric")
    main.add_column("value", justify="right")
    main.add_column("target", justify="right")
    main.add_column("met", justify="center")
    targets = res["targets"]

    def fmt(value: Any, unit: str) -> str:
        return "-" if value is None else f"{value}{unit}"

    def target_row(label: str, name: str, unit: str) -> None:
        t = targets[name]
        mark = benchlib.MET_MARK[t["met"]]
        main.add_row(label, fmt(t["value"], unit), t["target"] + unit, mark)

    main.add_row("cold boot (process start -> agent)", fmt(res.get("cold_boot_ms"), " ms"), "", "")
    target_row("fork p50", "fork_p50_ms", " ms")
    main.add_row("fork p90", fmt(res.get("fork_p90_ms"), " ms"), "", "")
    main.add_row(
        "fork p50 / p90, QEMU pre-started, state not loaded",
        f"{res.get('fork_pooled_p50_ms')} / {res.get('fork_pooled_p90_ms')} ms", "", "",
    )  # fmt: skip
    target_row("fork p50, warm pool hit (the daemon's pool)", "fork_pool_hit_p50_ms", " ms")
    main.add_row("fork p90, warm pool hit", fmt(res.get("fork_pool_hit_p90_ms"), " ms"), "", "")
    main.add_row(
        "first command after the fork p50: miss / pool hit",
        f"{res.get('first_exec_after_miss_ms_p50')} / "
        f"{res.get('first_exec_after_pool_hit_ms_p50')} ms", "", "",
    )  # fmt: skip
    main.add_row(
        "fork first / max", f"{res.get('fork_first_ms')} / {res.get('fork_max_ms')} ms", "", ""
    )
    target_row("cold boot / fork p50", "fork_vs_boot_ratio", "x")
    for label, value in qemu_baseline.table_rows(res):
        main.add_row(label, value, "", "")
    target_row(
        f"{res.get('concurrent_forks')} concurrent forks, wall", "fork10_concurrent_wall_ms", " ms"
    )
    target_row("snapshot pause, 256 MiB (median)", "snapshot_pause_ms_256", " ms")
    for key, label in (("private", "private"), ("rss", "RSS"), ("pss", "PSS")):
        main.add_row(
            f"idle child {label} p50 / max",
            f"{res.get(f'child_{key}_mib_p50')} / {res.get(f'child_{key}_mib_max')} MiB",
            "",
            "",
        )
    for label, value, target in bench.rows:
        main.add_row(label, value, target, "")
    out.print(main)

    if bench.pause_rows:
        pt = Table(title=f"snapshot pause window ({DIRTY_MIB} MiB dirtied after boot)")
        for col in ("RAM MiB", "pauses ms", "median ms", "capture_ms", "memory.bin MiB", "pages"):
            pt.add_column(col, justify="right")
        for row in bench.pause_rows:
            pt.add_row(*row)
        out.print(pt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory", type=int, default=256, help="template RAM in MiB (256)")
    p.add_argument("--forks", type=int, default=10, help="sequential forks for p50/p90 (10)")
    p.add_argument("--concurrent", type=int, default=10, help="forks started at once (10)")
    p.add_argument(
        "--pause-sizes",
        type=parse_sizes,
        default=parse_sizes("256,512,1024"),
        help="template sizes (MiB) for the snapshot pause window (256,512,1024)",
    )
    p.add_argument(
        "--baseline-runs",
        type=int,
        default=3,
        help="plain QEMU save/restore runs, for their p50 (3; 0 skips them)",
    )
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.forks < 1 or args.concurrent < 1:
        p.error("--forks and --concurrent must be at least 1")
    if args.baseline_runs < 0:
        p.error("--baseline-runs must be 0 or more")
    return benchlib.run_main(
        benchlib.amain(args, Bench, finish_results, render, workdir_prefix="forkd-bench-")
    )


if __name__ == "__main__":
    sys.exit(main())
