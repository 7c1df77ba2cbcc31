"""Branch benchmark: the pause of snapshotting a running VM, live against full, per RAM size.

``python bench/branch.py`` (``--json-only``: only the JSON line) times *full*
snapshots (pause, copy the pages written since the fork, resume) against *live*
ones (``live=True``: copy them while the VM runs, pause only for the pages written
since; ``precopied_pages`` 0: the host could not track writes, it paused to copy),
alternating, in the same run. Per ``--sizes`` size (256,1024): a running template
snapshotted ``--template-snapshots`` times per mode (3), the last (live) snapshot
being what the children fork from; per ``--written-mib`` amount (4,200, capped at
size - 112 MiB: 144 at 256 MiB) a child fills a buffer and is branched
``--branches`` times per mode (5), the whole buffer rewritten before each; a
grandchild of the last live branch must see the child's state. Then at the
smallest size (``--chain-only``: only this) a ``--chain-depth`` (5) diff chain, each
level a fork of the previous writing the smallest amount, and a full branch beside
the deepest, each forked ``--chain-forks`` times (3); the source's pause of each
diff and of that full branch is reported too (``diff_pause_ms``, ``full_pause_ms``).

Targets (``targets``; ``met`` on top: all met, None if one was not measured):
live pause p50 <= 15 ms with 4 MiB written and <= 40 ms with 200 MiB, template
live pause p50 <= 50 ms, at every size; fork ready p50 from the deepest diff <=
1.5x from the full one; each diff's ``memory.diff`` + ``memory.runs`` <= the pages
its child wrote since its fork (pagemap) + 1 MiB. VMs killed and the work dir
removed at the end, also on failure or Ctrl-C; the last stdout line is one JSON
object (``"error"`` and exit 1 if something failed; Ctrl-C: none, exit 130).
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
from forkd.vmm.snapshot import live as live_snapshot
from forkd.vmm.snapshot import memory, write_tracking
from forkd.vmm.snapshot.files import MEMORY_DIFF, MEMORY_RUNS, BaseRef, SnapshotLabels, load
from forkd.vmm.vm import VM

# Run as `python bench/branch.py`: bench/benchlib.py (not an installed package) is
# found through this folder, put first on sys.path (also under -P / PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib import MIB, allocated_mib, lookup, percentile, r1

MODES = ("full", "live")  # taken alternating, in this order
TEMPLATE_PAUSE_TARGET_MS = 50.0  # template live pause p50, every size
LIVE_PAUSE_TARGETS_MS = {4: 15.0, 200: 40.0}  # live branch pause p50 by MiB written asked for
CHAIN_FORK_RATIO_TARGET = 1.5  # deepest diff's fork p50 over a full snapshot's
DIFF_SLACK_MIB = 1.0  # a diff's disk beyond the pages its child wrote
# A buffer gets at most size - this: a 256 MiB guest has ~168 MiB available; with
# 160 MiB it thrashes (its page cache evicted and re-read), 144 takes 2 s.
GUEST_HEADROOM_MIB = 112
BIG_EVAL_SECS = 600.0  # an eval that fills or rewrites the buffer (~2 s per 144 MiB, TCG)

# Each chain level: fresh pages of its own (64 KiB pieces), and a marker the forks must see.
LEVEL_CODE = """\
import os
level_blob_{i} = bytearray({n} << 20)
for _off in range(0, len(level_blob_{i}), 1 << 16):
    level_blob_{i}[_off:_off + (1 << 16)] = os.urandom(1 << 16)
marker = {i}
(marker, level_blob_{i}[:8].hex())
"""

# Run once in the child: the buffer is allocated once and rewritten in place in
# 64 KiB pieces, so each branch dirties the same guest pages (no big temporaries).
SETUP_CODE = """\
import os
blob = bytearray({n} << 20)
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
_forkd_redirty(None)[1]
"""


# ------------------------------------------------------------------ helpers

parse_sizes = benchlib.sizes_parser("--sizes", at_least_one=True, sort_unique=True)


def parse_mib_list(text: str) -> list[int]:
    """``--written-mib``: comma-separated MiB amounts, each >= 1; sorted, no repeats."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--written-mib: {exc}") from exc
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("--written-mib: give amounts of at least 1 MiB")
    return values


def used_mib(size: int, asked: int) -> int:
    """What a ``size`` MiB guest can hold of ``asked`` MiB (see GUEST_HEADROOM_MIB)."""
    return min(asked, size - GUEST_HEADROOM_MIB)


def spread(values: list[float]) -> dict[str, Any]:
    """p50, p90, max and all of ``values``, rounded."""
    out: dict[str, Any] = {f"p{q}": r1(percentile(values, q)) for q in (50, 90)}
    return {**out, "max": r1(max(values)), "all": [r1(v) for v in values]}


def pages_written_since_fork(vm: VM) -> int:
    """Pages of ``vm``'s RAM it wrote since its mapping was made (its fork), per pagemap."""
    size = vm.machine.memory_mib << 20
    region = memory.find_ram_region(vm.pid, vm.ram_file, size, vm.ram_inode)
    return sum(e - f for f, e in memory.runs_of(memory.written_marks(region), 1 << 30))


async def checked_eval(vm: VM, code: str, what: str, timeout: float = BIG_EVAL_SECS) -> Any:
    out = await vm.guest.eval(code, timeout=timeout)
    if out.get("error"):
        raise RuntimeError(f"{what} failed: {out['error']}")
    return out.get("result")


class Bench(benchlib.BenchBase):
    """The branch benchmark, one RAM size after another (VM bookkeeping: BenchBase)."""

    SNAP_SEQ_DIGITS = 3

    # ---------------------------------------------------------------- templates

    async def _templates(self, image: guest_image.Image, size: int) -> tuple[Path, dict[str, Any]]:
        """Snapshot one running template, full and live alternating; keep the last one."""
        tpl = await self._boot(image, size)
        pauses: dict[str, list[float]] = {mode: [] for mode in MODES}
        precopied: list[int] = []
        kept: Path | None = None
        try:
            await checked_eval(tpl, "x = 41", "template warm-up eval")
            for i in range(self.args.template_snapshots):
                for mode in MODES:
                    dest = self._new_snap_dir(f"template-{size}-{mode}-{i}")
                    meta = (await live_snapshot.write(tpl, dest, live=mode == "live")).meta
                    pauses[mode].append(float(meta.pause_ms or 0.0))
                    if mode == "live":
                        precopied.append(meta.precopied_pages)
                    if kept is not None:
                        shutil.rmtree(kept, ignore_errors=True)
                    kept = dest
        finally:
            # Children map the snapshot's memory.bin, not the template: it can go.
            await self._kill([tpl])
        assert kept is not None
        self.results.setdefault("accel", tpl.machine.accel)
        return kept, {
            "full_pause_ms": spread(pauses["full"]),
            "live_pause_ms": spread(pauses["live"]),
            "live_precopied_pages": precopied,
            "boot_ms": r1(tpl.ready_ms),
        }

    # ---------------------------------------------------------------- branches

    async def _branch(self, child: VM, label: str, live: bool) -> dict[str, Any]:
        """Rewrite the child's buffer, branch it; returns the branch dir and its figures."""
        expected = await checked_eval(child, f"_forkd_redirty({label!r})", "re-dirtying eval")
        dest = self._new_snap_dir(label)
        t0 = time.monotonic()
        meta = (await live_snapshot.write(child, dest, live=live)).meta
        wall_ms = (time.monotonic() - t0) * 1000
        alloc = allocated_mib(dest / "memory.bin")
        return {"dir": dest, "state": expected, "meta": meta, "wall_ms": wall_ms, "alloc": alloc}

    async def _amount(self, tpl_snap: Path, size: int, asked: int) -> dict[str, Any]:
        """One child writing ``asked`` MiB (capped), branched full and live alternating."""
        n_mib = used_mib(size, asked)
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        kept: Path | None = None
        child: VM | None = None
        grandchild: VM | None = None
        try:
            self.say.log(f"{size} MiB, {n_mib} MiB written: forking a child, filling its buffer")
            child = await self._fork(tpl_snap)
            await checked_eval(child, SETUP_CODE.format(n=n_mib), "buffer setup eval")
            self.say.log(f"{size} MiB, {n_mib} MiB written: {self.args.branches} branches/mode")
            for i in range(self.args.branches):
                for mode in MODES:
                    info = await self._branch(
                        child, f"branch-{size}-{asked}-{mode}-{i}", mode == "live"
                    )
                    if kept is not None:  # only the newest branch is forked from
                        shutil.rmtree(kept, ignore_errors=True)
                    kept = info["dir"]
                    runs[mode].append(info)
            last = runs["live"][-1]  # live is taken last: ``kept``
            grandchild = await self._fork(last["dir"])
            seen = await checked_eval(grandchild, "_forkd_state()", "grandchild state eval")
            if seen != last["state"]:
                raise RuntimeError(f"the grandchild sees {seen}, the child had {last['state']}")
        finally:
            await self._kill([vm for vm in (grandchild, child) if vm is not None])
            if kept is not None:
                shutil.rmtree(kept, ignore_errors=True)
        out: dict[str, Any] = {"asked_mib": asked, "written_mib": n_mib}
        for mode, infos in runs.items():
            metas = [b["meta"] for b in infos]
            out[mode] = {
                "pause_ms": spread([float(m.pause_ms or 0.0) for m in metas]),
                "capture_ms_p50": r1(percentile([float(m.capture_ms) for m in metas], 50)),
                "wall_ms_p50": r1(percentile([b["wall_ms"] for b in infos], 50)),
                "precopied_pages": [m.precopied_pages for m in metas],
                "pages_written": [m.pages_written for m in metas],
                "memory_bin_alloc_mib": r1(infos[-1]["alloc"]),
            }
        out["grandchild_ready_ms"] = r1(grandchild.ready_ms)
        out["grandchild_state_ok"] = True
        return out

    def _branch_rows(self, size: int, entry: dict[str, Any]) -> None:
        used, asked = entry["written_mib"], entry["asked_mib"]
        written = f"{used}" if used == asked else f"{used} of {asked}"
        for mode in MODES:
            m = entry[mode]
            pre = m["precopied_pages"]
            pause = (f"{m['pause_ms'][k]:.1f}" for k in ("p50", "p90", "max"))
            self.rows.append(
                (str(size), written, mode, *pause, f"{m['capture_ms_p50']:.1f}",
                 f"{m['wall_ms_p50']:.1f}", f"{min(pre)}",
                 f"{m['memory_bin_alloc_mib']:.1f}")
            )  # fmt: skip

    async def _one_size(self, image: guest_image.Image, size: int) -> None:
        """Fill ``results["templates"][size]`` and ``results["branch"][size]`` as it goes."""
        key = str(size)
        self.say.log(f"{size} MiB: a template, {self.args.template_snapshots} snapshots/mode")
        try:
            tpl_snap, tpl = await self._templates(image, size)
        except Exception as exc:
            self.fail(f"the template snapshots at {size} MiB", exc)
            return
        self.results["templates"][key] = tpl
        branch = self.results["branch"].setdefault(key, {})
        try:
            for asked in self.args.written_mib:
                try:
                    branch[str(asked)] = entry = await self._amount(tpl_snap, size, asked)
                except Exception as exc:  # one amount failing must not hide the others
                    self.fail(f"branching at {size} MiB, {asked} MiB written", exc)
                    self.rows.append((key, str(asked), "[red]failed[/]", *("-",) * 7))
                    continue
                self._branch_rows(size, entry)
        finally:
            shutil.rmtree(tpl_snap, ignore_errors=True)

    async def run(self) -> None:
        self.results.update(templates={}, branch={})
        image = await self.python_image()
        if not self.args.chain_only:
            for size in self.args.sizes:
                await self._one_size(image, size)
        try:
            self.results["modes"] = await self._modes(image, min(self.args.sizes))
        except Exception as exc:
            self.fail("the branch modes", exc)

    # ---------------------------------------------------------------- modes

    async def _level(self, child: VM, i: int, base: Path | None) -> tuple[Path, Any, int]:
        """Write level ``i`` in ``child``; branch it, a diff over ``base`` (None: full).
        Returns the branch, the state forks must see and the pages written since the fork."""
        code = LEVEL_CODE.format(i=i, n=min(self.args.written_mib))
        state = await checked_eval(child, code, f"level {i} eval")
        pages = pages_written_since_fork(child)
        dest = self._new_snap_dir(f"{'diff' if base else 'full'}-{i}")
        ref = BaseRef(base.name, str(base), load(base).meta.id) if base else None
        await live_snapshot.write(child, dest, SnapshotLabels(tag=dest.name), ref)
        return dest, state, pages

    async def _timed_forks(self, snap: Path, level: int, expected: Any) -> list[float]:
        out = []
        for _ in range(self.args.chain_forks):
            vm = await self._fork(snap)
            try:
                code = f"(marker, level_blob_{level}[:8].hex())"
                seen = await checked_eval(vm, code, "fork state eval")
                if seen != expected:
                    raise RuntimeError(f"a fork of {snap.name} sees {seen}, expected {expected}")
                out.append(float(vm.ready_ms or 0.0))
            finally:
                await self._kill([vm])
        return out

    async def _modes(self, image: guest_image.Image, size: int) -> dict[str, Any]:
        depth = self.args.chain_depth
        self.say.log(f"modes at {size} MiB: a chain of {depth} diffs")
        tpl = await self._boot(image, size)
        try:
            await checked_eval(tpl, "x = 41", "template warm-up eval")
            tpl_snap = (await live_snapshot.write(tpl, self._new_snap_dir(f"template-{size}"))).dir
        finally:
            await self._kill([tpl])
        snaps: list[tuple[Path, Any, int]] = []
        try:
            base, child = tpl_snap, await self._fork(tpl_snap)
            for i in range(1, depth + 1):
                snaps.append(await self._level(child, i, base))
                if i == depth:
                    snaps.append(await self._level(child, i, None))  # a full one beside
                await self._kill([child])
                if i < depth:
                    base, child = snaps[-1][0], await self._fork(snaps[-1][0])
            forks = {
                "full": await self._timed_forks(snaps[-1][0], depth, snaps[-1][1]),
                "diff_depth_1": await self._timed_forks(snaps[0][0], 1, snaps[0][1]),
                f"diff_depth_{depth}": await self._timed_forks(snaps[-2][0], depth, snaps[-2][1]),
            }
            return self._mode_figures(tpl_snap, snaps, forks)
        finally:
            for d in [tpl_snap, *(s[0] for s in snaps)]:
                shutil.rmtree(d, ignore_errors=True)

    def _mode_figures(
        self, tpl: Path, snaps: list[tuple[Path, Any, int]], forks: dict[str, list[float]]
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
        diffs = snaps[:-1]
        return {
            "written_mib_per_level": min(self.args.written_mib),
            "fork_ready_ms_p50": p50,
            "fork_ready_ms_all": {k: [r1(x) for x in v] for k, v in forks.items()},
            "deepest_over_full": ratio,
            "diff_pages_written": [pages for _, _, pages in diffs],
            "diff_written_mib": [round(pages * memory.PAGE / MIB, 2) for _, _, pages in diffs],
            "diff_alloc_mib": [round(allocated_mib(d / MEMORY_DIFF)
                                     + allocated_mib(d / MEMORY_RUNS), 2) for d, _, _ in diffs],
            # The source's pause for each diff level and for the full branch beside the deepest.
            "diff_pause_ms": [load(d).meta.pause_ms for d, _, _ in diffs],
            "full_pause_ms": load(snaps[-1][0]).meta.pause_ms,
            "full_alloc_mib": r1(allocated_mib(snaps[-1][0] / "memory.bin")),
            "full_copy": {"ms": r1(copy_ms), "mib": r1(copied / MIB), "reflink": reflink},
        }  # fmt: skip


# ------------------------------------------------------------------ judging


def _target(name: str, value: float | None, bound: float | None) -> dict[str, Any]:
    met = None if value is None or bound is None else value <= bound
    return {"name": name, "value": value, "bound": bound, "met": met}


def targets(res: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for size in args.sizes:
        for asked in args.written_mib:
            bound = LIVE_PAUSE_TARGETS_MS.get(asked)
            if bound is not None:
                value = lookup(res, f"branch.{size}.{asked}.live.pause_ms.p50")
                name = f"live pause p50 ms, {size} MiB, {asked} MiB written"
                if used_mib(size, asked) != asked:
                    name += f" ({used_mib(size, asked)} used)"
                out.append(_target(name, value, bound))
        value = lookup(res, f"templates.{size}.live_pause_ms.p50")
        out.append(
            _target(f"template live pause p50 ms, {size} MiB", value, TEMPLATE_PAUSE_TARGET_MS)
        )
    modes = res.get("modes") or {}
    depth = args.chain_depth
    name = f"fork from a depth-{depth} diff / from a full snapshot (ready p50)"
    out.append(_target(name, modes.get("deepest_over_full"), CHAIN_FORK_RATIO_TARGET))
    written = modes.get("diff_written_mib") or [None] * depth
    alloc = modes.get("diff_alloc_mib") or [None] * depth
    for i, (w, a) in enumerate(zip(written, alloc, strict=True), 1):
        bound = None if w is None else round(w + DIFF_SLACK_MIB, 2)
        name = f"diff level {i} disk MiB <= written since its fork + 1 MiB"
        out.append(_target(name, a, bound))
    return out


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["sizes"] = args.sizes
    results["written_mib_asked"] = args.written_mib
    results["written_mib_used"] = {
        str(s): {str(a): used_mib(s, a) for a in args.written_mib} for s in args.sizes
    }
    results["branches_per_mode"] = args.branches
    results["template_snapshots_per_mode"] = args.template_snapshots
    results["host_cores"] = os.cpu_count()
    results["host_cores_usable"] = len(os.sched_getaffinity(0))
    results["write_tracking"] = write_tracking.problem() or "ok"
    live_pre = [p for t in results.get("templates", {}).values() for p in t["live_precopied_pages"]]
    for per_size in results.get("branch", {}).values():
        live_pre += [p for e in per_size.values() for p in e["live"]["precopied_pages"]]
    results["live_fallback"] = any(p == 0 for p in live_pre)
    judged = targets(results, args)
    results["targets"] = judged
    values_in = all(t["value"] is not None and t["bound"] is not None for t in judged)
    results["met"] = all(t["met"] for t in judged) if values_in else None
    return results


def _table(title: str, cols: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    table = Table(title=title)
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def render(out: Console, bench: Bench, results: dict[str, Any]) -> None:
    res = results
    head = f"{res.get('accel')}, {res['host_cores']} cores, write tracking: {res['write_tracking']}"
    n_tpl = res["template_snapshots_per_mode"]
    title = f"template pause, ms ({n_tpl}/mode)"
    tpls = [(str(s), res["templates"].get(str(s))) for s in res["sizes"]]
    rows = [
        (s, *(f"{t[f'{m}_pause_ms']['p50']:.1f}" if t else "-" for m in MODES)) for s, t in tpls
    ]
    out.print(_table(title, ("RAM MiB", "full pause p50", "live pause p50"), rows))
    title = (
        f"branches of a forked child ({head}; {res['branches_per_mode']} per mode, "
        f"alternating, the buffer rewritten before each; written capped at RAM - "
        f"{GUEST_HEADROOM_MIB}; precopied: pages; times in ms, sizes in MiB)"
    )
    cols = ("RAM", "written", "mode", "pause p50", "p90", "max", "capture p50", "wall p50",
            "precopied min", "alloc")  # fmt: skip
    out.print(_table(title, cols, bench.rows))
    used = res["written_mib_used"]
    caps = [f"{a} -> {u} at {s}" for s, c in used.items() for a, u in c.items() if int(a) != u]
    if caps:
        out.print(f"note: MiB written capped (no room for more beside the guest's kernel and "
                  f"agent): {', '.join(caps)} MiB RAM")  # fmt: skip
    if res["live_fallback"]:
        out.print("[yellow]note: some live snapshots copied nothing before the pause[/]")
    modes = res.get("modes")
    if modes:
        forks = ", ".join(f"{k} {v} ms" for k, v in modes["fork_ready_ms_p50"].items())
        out.print(f"fork ready p50: {forks}; deepest/full {modes['deepest_over_full']}")
        out.print(f"chain pause: diffs {modes['diff_pause_ms']} ms (level 1 first) vs a full "
                  f"branch beside the deepest {modes['full_pause_ms']} ms")  # fmt: skip
        copy = modes["full_copy"]
        out.print(f"disk: diffs {modes['diff_alloc_mib']} MiB (written since their forks "
                  f"{modes['diff_written_mib']} MiB) vs full {modes['full_alloc_mib']} MiB; "
                  f"a full branch's base copy: {copy['mib']} MiB in {copy['ms']} ms "
                  f"(reflink: {copy['reflink']})")  # fmt: skip
    mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "-"}
    for t in res["targets"]:
        out.print(f"target {t['name']}: {t['value']} (<= {t['bound']}), {mark[t['met']]}")
    out.print(f"all targets: {mark[res['met']]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for opt, parse, text, what in (
        ("--sizes", parse_sizes, "256,1024", "template/child RAM sizes in MiB"),
        ("--written-mib", parse_mib_list, "4,200", "MiB rewritten per branch, <= RAM - 112"),
    ):
        p.add_argument(opt, type=parse, default=parse(text), help=f"{what} ({text})")
    for opt, default, what in (
        ("--branches", 5, "branches per size, written amount and mode"),
        ("--template-snapshots", 3, "template snapshots per size and mode"),
        ("--chain-depth", 5, "diff levels in the chain"),
        ("--chain-forks", 3, "timed forks per chain snapshot"),
    ):
        p.add_argument(opt, type=int, default=default, help=f"{what} ({default})")
    p.add_argument("--chain-only", action="store_true", help="only the branch modes")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if min(args.chain_depth, args.chain_forks, args.branches, args.template_snapshots) < 1:
        p.error("--chain-depth, --chain-forks, --branches, --template-snapshots must be >= 1")
    room = min(args.sizes) - GUEST_HEADROOM_MIB
    if room < 1:
        p.error(f"each size must be above {GUEST_HEADROOM_MIB} MiB")
    if args.chain_depth * min(args.written_mib) > room:
        p.error(f"--chain-depth x the smallest --written-mib must fit in {room} MiB")
    return benchlib.run_main(
        benchlib.amain(args, Bench, finish_results, render, workdir_prefix="forkd-bbench-")
    )


if __name__ == "__main__":
    sys.exit(main())
