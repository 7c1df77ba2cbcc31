"""Branch benchmark: pause window of snapshotting a running forked child, per RAM size.

Run from the repository root::

    python bench/branch.py                 # table on stdout, then one JSON line
    python bench/branch.py --json-only     # only the JSON line

For each ``--sizes`` size (every VM is killed and the work directory removed at
the end, also on failure or Ctrl-C):

1. boot a template of that size, snapshot it, kill it;
2. fork one child from the template and dirty ``--dirty-mib`` MiB in it;
3. branch the child ``--branches`` times (``child.snapshot(dest)``: stage and
   clone the base while it runs, pause, capture, resume, commit), each time
   rewriting the same buffer first, so every branch has similar dirty memory;
   the pause window is read from each branch's ``snapshot.json`` (``pause_ms``),
   and the whole call is timed as ``branch_wall_ms``;
4. fork the first grandchild from the last (fresh) branch: its ``ready_ms`` is
   ``first_grandchild_fork_ms``; it must see the child's state at the branch;
5. record the branch's ``memory.bin`` allocated and logical size.

The last line of stdout is one JSON object, also when a size failed: then it
carries ``"error"`` and the process exits non-zero. Ctrl-C or SIGTERM stops the
run (VMs killed, work dir removed) without a JSON line, exit status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd.errors import ImageError
from forkd.guest import image as guest_image
from forkd.vmm.vm import VM

MIB = 1 << 20
PAUSE_TARGET_MS = 300.0  # pause p50 at 256 MiB
PAUSE_TARGET_SIZE = 256
LINEAR_BASE_SIZE = 256
LINEAR_SLACK = 1.25

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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def r1(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def allocated_mib(path: Path) -> float:
    return path.stat().st_blocks * 512 / MIB


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--sizes: {exc}") from exc
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes: give at least one size")
    if any(not 64 <= s <= 65536 for s in sizes):
        raise argparse.ArgumentTypeError("--sizes: each size must be 64..65536 MiB")
    return sorted(set(sizes))


def _check_eval(out: dict[str, Any], what: str) -> str | None:
    if out.get("error"):
        raise RuntimeError(f"{what} failed: {out['error']}")
    return out.get("result")


class Bench:
    """Owns every VM it starts, so cleanup can kill them all."""

    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        self.args = args
        self.workdir = workdir
        self.run_root = workdir / "run"
        self.snap_root = workdir / "snapshots"
        self.say = say
        self.vms: list[VM] = []
        self.results: dict[str, Any] = {}
        self.rows: list[tuple[str, ...]] = []  # one per size, for the table
        self.errors: list[str] = []
        self._snap_seq = 0

    # -------------------------------------------------------------- plumbing

    def _new_snap_dir(self, label: str) -> Path:
        self._snap_seq += 1
        return self.snap_root / f"{self._snap_seq:03d}-{label}"

    async def _boot(self, image: guest_image.Image, memory_mib: int) -> VM:
        vm = await VM.boot(image, run_root=self.run_root, memory_mib=memory_mib, vcpus=1)
        self.vms.append(vm)  # no await between boot's return and this: never lost
        return vm

    async def _fork(self, snap: Path) -> VM:
        vm = await VM.restore(snap, run_root=self.run_root)
        self.vms.append(vm)
        return vm

    async def _kill(self, vms: list[VM]) -> None:
        await asyncio.gather(*(vm.kill() for vm in vms), return_exceptions=True)
        for vm in vms:
            with contextlib.suppress(ValueError):
                self.vms.remove(vm)

    async def kill_all(self) -> None:
        await self._kill(list(self.vms))

    # ---------------------------------------------------------------- phases

    async def _template(self, image: guest_image.Image, size: int) -> tuple[Path, dict[str, Any]]:
        tpl = await self._boot(image, size)
        try:
            _check_eval(await tpl.eval("x = 41"), "template warm-up eval")
            snap = await tpl.snapshot(self._new_snap_dir(f"template-{size}"))
        finally:
            # Children map memory.bin, not the template: it can go.
            await self._kill([tpl])
        meta = json.loads((snap / "snapshot.json").read_text())
        return snap, {"boot_ms": tpl.ready_ms, "meta": meta}

    async def _branch(self, child: VM, size: int, i: int) -> dict[str, Any]:
        """Re-dirty the child, branch it; returns the branch dir and its figures."""
        tag = f"branch-{size}-{i}"
        expected = _check_eval(await child.eval(f"_forkd_redirty({tag!r})"), "re-dirtying eval")
        dest = self._new_snap_dir(f"branch-{size}-{i}")
        t0 = time.monotonic()
        await child.snapshot(dest)
        wall_ms = (time.monotonic() - t0) * 1000
        meta = json.loads((dest / "snapshot.json").read_text())
        mem = dest / "memory.bin"
        return {
            "dir": dest,
            "expected_state": expected,
            "pause_ms": float(meta["pause_ms"]),
            "wall_ms": wall_ms,
            "capture_ms": meta.get("capture_ms"),
            "pages_written": meta.get("pages_written"),
            "base_bytes_cloned": meta.get("base_bytes_cloned"),
            "alloc_mib": allocated_mib(mem),
            "logical_mib": mem.stat().st_size / MIB,
            "accel": meta.get("machine", {}).get("accel"),
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
                "template_pause_ms": tpl_meta.get("pause_ms"),
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

    def fail(self, what: str, exc: BaseException) -> None:
        message = f"{what}: {type(exc).__name__}: {exc}"
        self.errors.append(message)
        self.say.log(f"[red]failed:[/] {message}")

    async def run(self) -> None:
        try:
            image = guest_image.find_image("python")
        except ImageError:
            self.say.log("guest image 'python' missing: building it")
            image = await asyncio.to_thread(guest_image.build, "python")
        await self.run_sizes(image)


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


def kill_strays(workdir: Path) -> list[int]:
    """SIGKILL any QEMU whose command line names our work dir (a safety net)."""
    needle = str(workdir).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmdline.split(b"\0", 1)[0] and needle in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


async def amain(args: argparse.Namespace) -> int:
    out = Console(quiet=args.json_only, width=max(100, Console().width))
    say = Console(stderr=True, quiet=args.json_only, log_path=False)
    base = Path(args.workdir) if args.workdir else Path("/tmp")
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="forkd-bbench-", dir=base))
    bench = Bench(args, workdir, say)

    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)

    started = time.monotonic()
    try:
        await bench.run()
    except Exception as exc:
        bench.fail("benchmark", exc)
    finally:
        await bench.kill_all()
        strays = kill_strays(workdir)
        if strays:
            say.log(f"[yellow]killed leftover QEMU processes {strays}[/]")
        shutil.rmtree(workdir, ignore_errors=True)
        loop.remove_signal_handler(signal.SIGTERM)

    results = finish_results(bench.results, args)
    results["bench_secs"] = round(time.monotonic() - started, 1)
    if bench.errors:
        results["error"] = "; ".join(bench.errors)
    render(out, bench, results)
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    return 1 if bench.errors else 0


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
    p.add_argument("--workdir", help="where to make the temporary work dir (/tmp)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    if args.branches < 5:
        p.error("--branches must be at least 5")
    if not 1 <= args.dirty_mib <= min(args.sizes) // 4:
        p.error("--dirty-mib must be at least 1 and at most a quarter of the smallest size")
    try:
        return asyncio.run(amain(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    sys.exit(main())
