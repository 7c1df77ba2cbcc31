"""Branch benchmark: pause window of snapshotting a running forked child, per RAM size.

Run from the repository root::

    python bench/branch.py                 # table on stdout, then one JSON line
    python bench/branch.py --json-only     # only the JSON line

For each ``--sizes`` size (every VM is killed and the work directory removed at
the end, also on failure or Ctrl-C):

1. boot a template of that size, snapshot it, kill it;
2. fork one child from the template and dirty ``--dirty-mib`` MiB in it;
3. branch the child ``--branches`` times (``child.write_snapshot(dest)``: stage and
   clone the base while it runs, pause, capture, resume, commit), each time
   rewriting the same buffer first, so every branch has similar dirty memory;
   the pause window is each branch's recorded ``pause_ms`` (its ``snapshot.json``),
   and the whole call is timed as ``branch_wall_ms``;
4. fork the first grandchild from the last (fresh) branch: its ``ready_ms`` is
   ``first_grandchild_fork_ms``; it must see the child's state at the branch;
5. record the branch's ``memory.bin`` allocated and logical size.

Then the branch modes, at the smallest size (``--chain-depth`` levels, default 5;
``--chain-only`` skips the sizes above):

6. fork a child from the template, dirty ``--dirty-mib`` MiB, branch it as a diff
   over the template; fork the diff and do the same again, ``--chain-depth`` times;
   a full branch of the last child is taken too (the same guest state);
7. fork each of the full branch, the depth-1 diff and the deepest diff
   ``--chain-forks`` times: ``ready_ms`` p50 each, and the deepest's ratio to the
   full one (the target: at most 1.5); each fork must see its level's state;
8. the disk cost: a diff's allocated ``memory.diff`` against a full ``memory.bin``,
   and what a full branch's copy of the base costs on this filesystem (timed
   ``memory.copy_sparse`` of the template's ``memory.bin``, reflink or not).

The last line of stdout is one JSON object, also when a size failed: then it
carries ``"error"`` and the process exits non-zero. Ctrl-C or SIGTERM stops the
run (VMs killed, work dir removed) without a JSON line, exit status 130.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd.guest import image as guest_image
from forkd.vmm import memory
from forkd.vmm.snapshot_files import BaseRef, SnapshotLabels
from forkd.vmm.vm import VM

# These scripts run as `python bench/<name>.py`; the shared helpers live next to
# them in bench/benchlib.py, which is not an installed package. Put this file's
# folder first on sys.path so `import benchlib` works from any cwd (Python does
# that for a script already, but not under -P / PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib import MIB, allocated_mib, percentile, r1

PAUSE_TARGET_MS = 300.0  # pause p50 at 256 MiB
PAUSE_TARGET_SIZE = 256
LINEAR_BASE_SIZE = 256
LINEAR_SLACK = 1.25
CHAIN_FORK_RATIO_TARGET = 1.5  # deepest diff's fork p50 over a full snapshot's

# Each chain level: fresh pages of its own, and a marker the forks must see.
LEVEL_CODE = """\
import os
level_blob_{i} = bytearray(os.urandom({n} << 20))
marker = {i}
(marker, level_blob_{i}[:8].hex())
"""

# Run once in the child: the buffer is allocated once and rewritten in place in
# 64 KiB pieces, so each branch dirties the same guest pages (no big temporaries).
SETUP_CODE = """\
import os
blob = bytearray(os.urandom({n} << 20))
def _forkd_redirty(tag):
    global marker
    step = 1 << 16
    for off in range(0, len(blob), step):
        blob[off:off + step] = os.urandom(step)
    marker = tag
    return _forkd_state()
def _forkd_state():
    return (marker, len(blob), blob[:16].hex() + blob[-16:].hex())
marker = None
len(blob)
"""


# ------------------------------------------------------------------ helpers

parse_sizes = benchlib.sizes_parser("--sizes", at_least_one=True, sort_unique=True)


def _check_eval(out: dict[str, Any], what: str) -> str | None:
    if out.get("error"):
        raise RuntimeError(f"{what} failed: {out['error']}")
    return out.get("result")


class Bench(benchlib.BenchBase):
    """The branch benchmark, one RAM size after another (VM bookkeeping: BenchBase)."""

    SNAP_SEQ_DIGITS = 3

    # ---------------------------------------------------------------- phases

    async def _template(self, image: guest_image.Image, size: int) -> tuple[Path, dict[str, Any]]:
        tpl = await self._boot(image, size)
        try:
            _check_eval(await tpl.eval("x = 41"), "template warm-up eval")
            snap = await tpl.write_snapshot(self._new_snap_dir(f"template-{size}"))
        finally:
            # Children map memory.bin, not the template: it can go.
            await self._kill([tpl])
        return snap.dir, {"boot_ms": tpl.ready_ms, "meta": snap.meta}

    async def _branch(self, child: VM, size: int, i: int) -> dict[str, Any]:
        """Re-dirty the child, branch it; returns the branch dir and its figures."""
        tag = f"branch-{size}-{i}"
        expected = _check_eval(await child.eval(f"_forkd_redirty({tag!r})"), "re-dirtying eval")
        dest = self._new_snap_dir(f"branch-{size}-{i}")
        t0 = time.monotonic()
        meta = (await child.write_snapshot(dest)).meta
        wall_ms = (time.monotonic() - t0) * 1000
        mem = dest / "memory.bin"
        return {
            "dir": dest,
            "expected_state": expected,
            "pause_ms": float(meta.pause_ms or 0.0),
            "wall_ms": wall_ms,
            "capture_ms": meta.capture_ms,
            "pages_written": meta.pages_written,
            "base_bytes_cloned": meta.base_bytes_cloned,
            "alloc_mib": allocated_mib(mem),
            "logical_mib": mem.stat().st_size / MIB,
            "accel": meta.machine.accel,
        }

    async def _one_size(self, image: guest_image.Image, size: int) -> dict[str, Any]:
        n_dirty, n_branches = self.args.dirty_mib, self.args.branches
        self.say.log(f"{size} MiB: booting and snapshotting a template")
        tpl_snap, tpl_info = await self._template(image, size)
        kept: list[Path] = [tpl_snap]
        child: VM | None = None
        grandchild: VM | None = None
        try:
            self.say.log(f"{size} MiB: forking a child, dirtying {n_dirty} MiB")
            child = await self._fork(tpl_snap)
            _check_eval(await child.eval(SETUP_CODE.format(n=n_dirty)), "dirtying eval")

            self.say.log(f"{size} MiB: branching the child {n_branches} times")
            infos: list[dict[str, Any]] = []
            for i in range(n_branches):
                info = await self._branch(child, size, i)
                kept.append(info["dir"])
                if infos:  # only the newest branch is forked from: drop the older ones
                    shutil.rmtree(infos[-1]["dir"], ignore_errors=True)
                infos.append(info)
            last = infos[-1]

            self.say.log(f"{size} MiB: forking the first grandchild from the last branch")
            t0 = time.monotonic()
            grandchild = await self._fork(last["dir"])
            grand_wall_ms = (time.monotonic() - t0) * 1000
            seen = _check_eval(await grandchild.eval("_forkd_state()"), "grandchild state eval")
            if seen != last["expected_state"]:
                raise RuntimeError(
                    f"the grandchild sees {seen}, the child had {last['expected_state']}"
                )
        finally:
            await self._kill([vm for vm in (grandchild, child) if vm is not None])
            for d in kept:
                shutil.rmtree(d, ignore_errors=True)
        return {
            "template": tpl_info,
            "branches": infos,
            "grandchild_ready_ms": grandchild.ready_ms,
            "grandchild_wall_ms": grand_wall_ms,
            "grandchild_state_ok": True,
        }

    async def run_sizes(self, image: guest_image.Image) -> None:
        res = self.results
        # Filled in as sizes finish, so a later failure keeps the earlier figures.
        pause = res.setdefault("pause_ms", {})
        wall = res.setdefault("branch_wall_ms", {})
        grand = res.setdefault("first_grandchild_fork_ms", {})
        alloc = res.setdefault("memory_bin_alloc_mib", {})
        logical = res.setdefault("memory_bin_logical_mib", {})
        detail = res.setdefault("detail", {})
        for size in self.args.sizes:
            key = str(size)
            try:
                info = await self._one_size(image, size)
            except Exception as exc:  # one size failing must not hide the others
                self.fail(f"branching at {size} MiB", exc)
                pause[key] = wall[key] = grand[key] = alloc[key] = logical[key] = None
                self.rows.append((key, "[red]failed[/]", *("-",) * 6))
                continue
            branches = info["branches"]
            pauses = [b["pause_ms"] for b in branches]
            walls = [b["wall_ms"] for b in branches]
            captures = [b["capture_ms"] or 0.0 for b in branches]
            last = branches[-1]
            res.setdefault("accel", last["accel"])
            pause[key] = {
                "p50": r1(percentile(pauses, 50)),
                "p90": r1(percentile(pauses, 90)),
                "max": r1(max(pauses)),
                "all": [r1(p) for p in pauses],
            }
            wall[key] = r1(percentile(walls, 50))
            grand[key] = r1(info["grandchild_ready_ms"])
            alloc[key] = r1(last["alloc_mib"])
            logical[key] = r1(last["logical_mib"])
            tpl_meta = info["template"]["meta"]
            detail[key] = {
                "branch_wall_ms_all": [r1(w) for w in walls],
                "capture_ms_p50": r1(percentile(captures, 50)),
                "pages_written": [b["pages_written"] for b in branches],
                "base_mib_cloned": r1((last["base_bytes_cloned"] or 0) / MIB),
                "memory_bin_alloc_mib_all": [r1(b["alloc_mib"]) for b in branches],
                "grandchild_restore_wall_ms": r1(info["grandchild_wall_ms"]),
                "grandchild_state_ok": info["grandchild_state_ok"],
                "template_boot_ms": r1(info["template"]["boot_ms"]),
                "template_pause_ms": tpl_meta.pause_ms,
            }
            self.rows.append(
                (
                    key,
                    f"{pause[key]['p50']:.1f}",
                    f"{pause[key]['p90']:.1f}",
                    f"{pause[key]['max']:.1f}",
                    f"{percentile(captures, 50):.1f}",
                    f"{wall[key]:.1f}",
                    f"{grand[key]:.1f}",
                    f"{alloc[key]:.1f} / {logical[key]:.0f}",
                )
            )

    async def run(self) -> None:
        image = await self.python_image()
        if not self.args.chain_only:
            await self.run_sizes(image)
        try:
            self.results["modes"] = await self._modes(image, min(self.args.sizes))
        except Exception as exc:
            self.fail("the branch modes", exc)

    # ---------------------------------------------------------------- modes

    async def _level(self, child: VM, i: int, base: Path | None) -> tuple[Path, Any]:
        """Dirty ``child`` as level ``i``; branch it, a diff over ``base`` (None: full)."""
        code = LEVEL_CODE.format(i=i, n=self.args.dirty_mib)
        state = _check_eval(await child.eval(code), f"level {i} eval")
        dest = self._new_snap_dir(f"{'diff' if base else 'full'}-{i}")
        ref = BaseRef(base.name, str(base)) if base else None
        await child.write_snapshot(dest, SnapshotLabels(tag=dest.name), ref)
        return dest, state

    async def _timed_forks(self, snap: Path, level: int, expected: Any) -> list[float]:
        out = []
        for _ in range(self.args.chain_forks):
            vm = await self._fork(snap)
            try:
                code = f"(marker, level_blob_{level}[:8].hex())"
                seen = _check_eval(await vm.eval(code), "fork state eval")
                if seen != expected:
                    raise RuntimeError(f"a fork of {snap.name} sees {seen}, expected {expected}")
                out.append(float(vm.ready_ms or 0.0))
            finally:
                await self._kill([vm])
        return out

    async def _modes(self, image: guest_image.Image, size: int) -> dict[str, Any]:
        self.say.log(f"modes at {size} MiB: a chain of {self.args.chain_depth} diffs")
        tpl, _ = await self._template(image, size)
        snaps: list[tuple[Path, Any]] = []
        try:
            base, child = tpl, await self._fork(tpl)
            for i in range(1, self.args.chain_depth + 1):
                d, state = await self._level(child, i, base)
                snaps.append((d, state))
                if i == self.args.chain_depth:
                    snaps.append(await self._level(child, i, None))  # a full one beside
                await self._kill([child])
                if i < self.args.chain_depth:
                    base, child = d, await self._fork(d)
            depth = self.args.chain_depth
            forks = {
                "full": await self._timed_forks(snaps[-1][0], depth, snaps[-1][1]),
                "diff_depth_1": await self._timed_forks(snaps[0][0], 1, snaps[0][1]),
                f"diff_depth_{depth}": await self._timed_forks(snaps[-2][0], depth, snaps[-2][1]),
            }
            return self._mode_figures(tpl, snaps, forks)
        finally:
            for d in [tpl, *(s[0] for s in snaps)]:
                shutil.rmtree(d, ignore_errors=True)

    def _mode_figures(
        self, tpl: Path, snaps: list[tuple[Path, Any]], forks: dict[str, list[float]]
    ) -> dict[str, Any]:
        p50 = {k: r1(percentile(v, 50)) for k, v in forks.items()}
        deep = p50[f"diff_depth_{self.args.chain_depth}"]
        ratio = round(deep / p50["full"], 2) if deep and p50["full"] else None
        out = tpl.parent / ".copy-probe"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        src = os.open(tpl / "memory.bin", os.O_RDONLY)
        try:
            size = os.fstat(src).st_size
            t0 = time.monotonic()
            os.ftruncate(fd, size)
            copied, reflink = memory.copy_sparse(src, fd, size)
            os.fsync(fd)
            copy_ms = (time.monotonic() - t0) * 1000
        finally:
            os.close(src)
            os.close(fd)
            out.unlink()
        return {
            "fork_ready_ms_p50": p50,
            "fork_ready_ms_all": {k: [r1(x) for x in v] for k, v in forks.items()},
            "deepest_over_full": ratio,
            "target": {"name": f"deepest/full <= {CHAIN_FORK_RATIO_TARGET}",
                       "met": None if ratio is None else ratio <= CHAIN_FORK_RATIO_TARGET},
            "diff_alloc_mib": [r1(allocated_mib(d / "memory.diff")) for d, _ in snaps[:-1]],
            "full_alloc_mib": r1(allocated_mib(snaps[-1][0] / "memory.bin")),
            "full_copy": {"ms": r1(copy_ms), "mib": r1(copied / MIB), "reflink": reflink},
        }  # fmt: skip


def _p50(results: dict[str, Any], size: int) -> float | None:
    entry = results.get("pause_ms", {}).get(str(size))
    return entry["p50"] if entry else None


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["sizes"] = args.sizes
    results["dirty_mib"] = args.dirty_mib
    results["branches"] = args.branches
    results["host_cores"] = os.cpu_count()
    results["host_cores_usable"] = len(os.sched_getaffinity(0))
    value = _p50(results, PAUSE_TARGET_SIZE)
    results["target"] = {
        "name": f"pause p50 <= {PAUSE_TARGET_MS:g} ms at {PAUSE_TARGET_SIZE} MiB",
        "value": value,
        "met": None if value is None else value <= PAUSE_TARGET_MS,
    }
    base = _p50(results, LINEAR_BASE_SIZE)
    ratios: dict[str, Any] = {}
    for size in args.sizes:
        p50 = _p50(results, size)
        if size == LINEAR_BASE_SIZE or base is None or p50 is None or base <= 0:
            continue
        bound = size / LINEAR_BASE_SIZE * LINEAR_SLACK
        ratio = p50 / base
        ok = ratio <= bound
        ratios[str(size)] = {"ratio": round(ratio, 2), "bound": round(bound, 2), "ok": ok}
    results["linear_growth"] = {
        "rule": f"p50(size)/p50({LINEAR_BASE_SIZE}) <= size/{LINEAR_BASE_SIZE} * {LINEAR_SLACK}",
        "ratios": ratios,
        "met": all(r["ok"] for r in ratios.values()) if ratios else None,
    }
    return results


def render(out: Console, bench: Bench, results: dict[str, Any]) -> None:
    res = results
    table = Table(
        title=(
            f"forkd branch benchmark ({res.get('accel')}, {res['host_cores']} cores, "
            f"{res['branches']} branches, {res['dirty_mib']} MiB re-dirtied per branch; "
            "times in ms, sizes in MiB)"
        )
    )
    for col in (
        "RAM",
        "pause p50",
        "p90",
        "max",
        "capture p50",
        "branch wall p50",
        "1st grandchild fork",
        "memory.bin alloc / size",
    ):
        table.add_column(col, justify="right")
    for row in bench.rows:
        table.add_row(*row)
    out.print(table)
    target, linear = res["target"], res["linear_growth"]
    mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "-"}
    out.print(f"target {target['name']}: {target['value']} ms, {mark[target['met']]}")
    ratios = ", ".join(
        f"{size}: {r['ratio']} (<= {r['bound']})" for size, r in linear["ratios"].items()
    )
    out.print(f"linear growth {linear['rule']}: {ratios or '-'}, {mark[linear['met']]}")
    modes = res.get("modes")
    if modes:
        forks = ", ".join(f"{k} {v} ms" for k, v in modes["fork_ready_ms_p50"].items())
        out.print(f"fork ready p50: {forks}; deepest/full {modes['deepest_over_full']} "
                  f"({modes['target']['name']}: {mark[modes['target']['met']]})")  # fmt: skip
        copy = modes["full_copy"]
        out.print(f"disk: diffs {modes['diff_alloc_mib']} MiB vs full {modes['full_alloc_mib']} "
                  f"MiB; a full branch's base copy: {copy['mib']} MiB in {copy['ms']} ms "
                  f"(reflink: {copy['reflink']})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("256,512,1024"),
        help="template/child RAM sizes in MiB (256,512,1024)",
    )
    p.add_argument("--branches", type=int, default=6, help="branches per size, >= 5 (6)")
    p.add_argument(
        "--dirty-mib", type=int, default=4, help="MiB rewritten in the child before each branch (4)"
    )
    p.add_argument("--chain-depth", type=int, default=5, help="diff levels in the chain (5)")
    p.add_argument("--chain-forks", type=int, default=3, help="timed forks per mode (3)")
    p.add_argument("--chain-only", action="store_true", help="only the branch modes")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.chain_depth < 1 or args.chain_forks < 1:
        p.error("--chain-depth and --chain-forks must be at least 1")
    if args.branches < 5:
        p.error("--branches must be at least 5")
    if not 1 <= args.dirty_mib <= min(args.sizes) // 4:
        p.error("--dirty-mib must be at least 1 and at most a quarter of the smallest size")
    return benchlib.run_main(
        benchlib.amain(args, Bench, finish_results, render, workdir_prefix="forkd-bbench-")
    )


if __name__ == "__main__":
    sys.exit(main())
