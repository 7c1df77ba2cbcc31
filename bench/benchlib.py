"""Shared plumbing of the benchmarks in this folder (fork.py, branch.py, stream.py, burst.py).

Not a benchmark itself: the scripts import it by name, with their own folder put
on ``sys.path`` (see the top of either script). It holds the small numeric
helpers and the judging of targets (:func:`judge`), the VM bookkeeping every
benchmark needs (:class:`BenchBase`; :class:`DaemonBench` for one run through a
``forkd serve`` of its own), the
options both take (``--workdir``, ``--json-only``) and the run around a
benchmark (:func:`amain`, :func:`run_main`): work dir, SIGTERM, cleanup of every VM also on
failure or Ctrl-C, the table, the final JSON line and the exit status.
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
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

import leaks  # this folder is on sys.path: see the module docstring
from forkd import accel
from forkd.client import Controller
from forkd.errors import ImageError
from forkd.guest import image as guest_image
from forkd.launcher import DaemonProcess
from forkd.vmm.qemu.host_processes import qemu_pids_under
from forkd.vmm.vm import VM

MIB = 1 << 20


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


def cpu_secs(pid: int, waited_children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 once it is gone.
    ``waited_children``: those of the children it waited for instead (helper programs)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    first = 13 if waited_children else 11
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def lookup(results: dict[str, Any], dotted: str) -> Any:
    """``results["a"]["b"]`` for ``"a.b"``; None where a part is missing."""
    value: Any = results
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


Targets = dict[str, tuple[str, str, float]]  # name: (dotted metric key, "<=" or ">=", bound)


def judge(results: dict[str, Any], targets: Targets) -> dict[str, dict[str, Any]]:
    """Each target with its value, its bound and whether it was met (None: not measured)."""
    judged = {}
    for name, (key, op, bound) in targets.items():
        value = lookup(results, key)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        judged[name] = {"value": value, "target": f"{op} {bound:g}", "met": met}
    return judged


MET_MARK = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}  # a target's ``met``


def targets_table(title: str, targets: dict[str, dict[str, Any]]) -> Table:
    """A table of figure, value, target and met, a row per target :func:`judge` judged;
    the caller adds rows of its other figures."""
    t = Table(title=title)
    for col in ("figure", "value", "target", "met"):
        t.add_column(col)
    for name, tgt in targets.items():
        t.add_row(name, str(tgt["value"]), tgt["target"], MET_MARK[tgt["met"]])
    return t


def allocated_mib(path: Path) -> float:
    return path.stat().st_blocks * 512 / MIB


def sizes_parser(
    option: str, *, at_least_one: bool = False, sort_unique: bool = False
) -> Callable[[str], list[int]]:
    """An argparse ``type`` for a comma-separated list of RAM sizes in MiB (64..65536).

    ``option`` names the option in error messages; ``at_least_one`` rejects an
    empty list; ``sort_unique`` returns the sizes sorted, without repeats
    (otherwise as given).
    """

    def parse_sizes(text: str) -> list[int]:
        try:
            sizes = [int(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{option}: {exc}") from exc
        if at_least_one and not sizes:
            raise argparse.ArgumentTypeError(f"{option}: give at least one size")
        if any(not 64 <= s <= 65536 for s in sizes):
            raise argparse.ArgumentTypeError(f"{option}: each size must be 64..65536 MiB")
        return sorted(set(sizes)) if sort_unique else sizes

    return parse_sizes


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark takes (added last, after its own)."""
    p.add_argument("--workdir", help="where to make the temporary work dir (/tmp)")
    p.add_argument("--json-only", action="store_true", help="print only the JSON line")


def kill_strays(workdir: Path) -> list[int]:
    """SIGKILL any QEMU whose command line names our work dir (a safety net)."""
    killed = []
    for pid in qemu_pids_under(workdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


# ------------------------------------------------------------------ the bench


class BenchBase:
    """Owns every VM it starts, so cleanup can kill them all.

    A benchmark subclasses it and implements :meth:`run`; it fills
    ``results`` (the JSON line), ``rows`` (for its table) and, through
    :meth:`fail`, ``errors``.
    """

    SNAP_SEQ_DIGITS = 2  # width of the sequence number in snapshot dir names

    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        self.args = args
        self.workdir = workdir
        self.run_root = workdir / "run"
        self.snap_root = workdir / "snapshots"
        self.say = say
        self.vms: list[VM] = []
        self.results: dict[str, Any] = {}
        self.rows: list[tuple[str, ...]] = []  # for the table
        self.errors: list[str] = []
        self._snap_seq = 0

    def _new_snap_dir(self, label: str) -> Path:
        self._snap_seq += 1
        return self.snap_root / f"{self._snap_seq:0{self.SNAP_SEQ_DIGITS}d}-{label}"

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

    async def python_image(self) -> guest_image.Image:
        """The 'python' guest image, built first if it is missing."""
        try:
            return guest_image.find_image("python")
        except ImageError:
            self.say.log("guest image 'python' missing: building it")
            return await asyncio.to_thread(guest_image.build, "python")

    def fail(self, what: str, exc: BaseException) -> None:
        message = f"{what}: {type(exc).__name__}: {exc}"
        self.errors.append(message)
        self.say.log(f"[red]failed:[/] {message}")

    async def run(self) -> None:
        raise NotImplementedError


class DaemonBench(BenchBase):
    """A benchmark run through a ``forkd serve`` of its own (stream.py, burst.py): it
    implements :meth:`bench` (blocking, with the SDK); the daemon and whatever it left
    are removed at the end, also on failure or Ctrl-C."""

    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.daemon = DaemonProcess(workdir / "state")

    def controller(self, timeout: float = 600) -> Controller:
        return Controller(self.daemon.url, token_file=self.daemon.token_path, timeout=timeout)

    def bench(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        self.results["accel"] = accel.choose().name
        await asyncio.to_thread(self.bench)

    async def kill_all(self) -> None:
        await asyncio.to_thread(self._stop_daemon)

    def _stop_daemon(self) -> None:
        """The daemon, then whatever of its VMs, namespaces and groups it left."""
        with contextlib.suppress(Exception):
            self.daemon.stop(signal.SIGKILL)
        leaks.remove_leftovers(self.daemon.state_dir, leaks.id_prefix(self.daemon.state_dir))


# ------------------------------------------------------------------ the run

B = TypeVar("B", bound=BenchBase)
Results = dict[str, Any]


async def amain(
    args: argparse.Namespace,
    bench_cls: Callable[[argparse.Namespace, Path, Console], B],
    finish_results: Callable[[Results, argparse.Namespace], Results],
    render: Callable[[Console, B, Results], None],
    *,
    workdir_prefix: str,
) -> int:
    """Run ``bench_cls(...).run()`` in a fresh work dir, then print its table and JSON line.

    Every VM is killed and the work dir removed whatever happens; a failure is
    recorded in the JSON line (``"error"``) and makes the exit status 1.
    """
    out = Console(quiet=args.json_only, width=max(100, Console().width))
    say = Console(stderr=True, quiet=args.json_only, log_path=False)
    base = Path(args.workdir) if args.workdir else Path("/tmp")
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=workdir_prefix, dir=base))
    bench = bench_cls(args, workdir, say)

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


def run_main(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` (an :func:`amain` call) in an event loop and return its exit status.

    Ctrl-C or SIGTERM stop it (VMs killed, work dir removed) with exit status
    130 and no JSON line.
    """
    try:
        return asyncio.run(main)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


def private_breakdown(
    pid: int, ram_file_names: tuple[str, ...] = ("memory.bin", "ram.bin")
) -> dict[str, float]:
    """Where a QEMU process's private dirty memory goes (MiB), from its smaps: the guest
    pages it wrote, TCG's translation cache (the one anonymous mapping of about
    tb-size), the heap, the data of QEMU and its libraries, and other anonymous
    memory (thread stacks, device buffers, allocator arenas)."""
    from forkd.vmm.qemu.argv import TCG_TB_SIZE_MIB

    parts = dict.fromkeys(("guest_written", "tcg_cache", "heap", "binaries", "other"), 0.0)
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name = head[5] if len(head) > 5 else ""
            if Path(name).name in ram_file_names:
                kind = "guest_written"
            elif not name and abs((hi - lo) - (TCG_TB_SIZE_MIB << 20)) <= 1 << 20:
                kind = "tcg_cache"
            elif name == "[heap]":
                kind = "heap"
            elif name.startswith("/"):
                kind = "binaries"
            else:
                kind = "other"
        elif head[0] == "Private_Dirty:":
            parts[kind] += int(head[1]) / 1024
    return {k: round(v, 1) for k, v in parts.items()}
