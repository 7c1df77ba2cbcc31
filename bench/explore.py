"""Explore benchmark: a tree search through ``explore`` beside the same search re-running setup.

Run from the repository root::

    python bench/explore.py                    # table on stdout, then one JSON line
    python bench/explore.py --setup-secs 3     # a quick run
    python bench/explore.py --json-only        # only the JSON line

It starts its own ``forkd serve`` (a temporary state dir, caps raised to fit
the run), builds a template of the ``python`` image and measures through the
SDK, in one run, two ways of scoring every trajectory of a search ``--depth``
levels deep with ``--variants`` choices per level (64 leaves by default) on a
task whose setup costs about ``--setup-secs``:

1. ``explore``: one sandbox forked from the template runs the setup once, then
   ``explore(source, variants, keep=all)``; each kept child is explored in turn
   (depth first; a sandbox is killed once explored, a kept branch deleted once
   its children are), the last level with ``keep=0``. Per explore call: its
   wall time against (its ``fork_ms`` + the slowest variant) x 1.2.
2. ``baseline``: every trajectory on its own: fork the template, run the setup,
   its steps and the score, kill it; ``--baseline-concurrency`` at once (as many
   as an explore runs variants at once, by default).

For each side: wall time, the CPU seconds of the daemon and every QEMU (reaped
ones included) and the peak of their summed PSS, sampled every 0.5 s. Every leaf's
score must equal its trajectory's baseline score, or it prints FAIL and exits 1.
bench/README.md says what each figure is. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import resource
import shutil
import string
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd.client import Controller
from forkd.client.explore import ExploreResult
from forkd.vmm.qemu import host_processes
from forkd.vmm.qemu.host_processes import qemu_pids_under

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
import benchlib
from benchlib import MIB, cpu_secs, judge, percentile, r1

TEMPLATE = "explore-bench"
CHOICES = string.ascii_lowercase  # variant i of a level appends CHOICES[i] to the path
SAMPLE_SECS = 0.5
CALIBRATE_SECS = 3
EXPLORE_TIMEOUT_SECS = 900
SLACK = 1.2  # an explore call may take (fork + slowest variant) x this
TARGETS = {  # name: (metric key, comparison, bound)
    "explore_speedup": ("explore_speedup", ">=", 10.0),
    # the worst explore call of any level: wall / (fork_ms + slowest variant's duration_ms)
    "per_level_within_fork_plus_slowest_plus_20pct": ("per_level_worst_ratio", "<=", SLACK),
}

# The task, run in the guest as /work/task.py. `setup ROUNDS SECS` builds a data file
# (ROUNDS chained SHA-256 rounds, a 512-byte record every 64) and its digest, then
# sleeps until SECS passed; `step CHOICE ROUNDS` appends CHOICE to the path and a
# hash chain of ROUNDS rounds over (data digest + path) to the state, printing the
# path; `score` prints a number from the state; `rate SECS` prints rounds per second.
TASK_PY = r"""
import hashlib, os, sys, time

DATA, DIGEST = "/work/data.bin", "/work/data.sha256"
PATH, STATE = "/work/path.txt", "/work/state.txt"
RECORD_ROUNDS = 64


def chain(h, rounds):
    for _ in range(rounds):
        h = hashlib.sha256(h).digest()
    return h


def setup(rounds, secs):
    began = time.monotonic()
    h, digest = b"forkd explore bench", hashlib.sha256()
    with open(DATA, "wb") as f:
        for _ in range(max(1, rounds // RECORD_ROUNDS)):
            h = chain(h, RECORD_ROUNDS)
            f.write(h * 16)
            digest.update(h * 16)
    with open(DIGEST, "w") as f:
        f.write(digest.hexdigest())
    for name in (PATH, STATE):
        open(name, "w").close()
    built = time.monotonic() - began
    time.sleep(max(0.0, secs - built))
    print(f"{os.path.getsize(DATA)} bytes built in {built:.2f} s")


def step(choice, rounds):
    with open(PATH) as f:
        path = f.read() + choice
    with open(PATH, "w") as f:
        f.write(path)
    with open(DIGEST) as f:
        h = chain((f.read() + path).encode(), rounds)
    with open(STATE, "a") as f:
        f.write(h.hex() + "\n")
    print(path)


def score():
    with open(STATE, "rb") as f:
        h = hashlib.sha256(f.read()).digest()
    print(f"{int.from_bytes(h[:4], 'big') / 2**32 * 100:.4f}")


def rate(secs):
    h, n, began = b"rate", 0, time.monotonic()
    while time.monotonic() - began < secs:
        h = chain(h, 1000)
        n += 1000
    print(n / (time.monotonic() - began))


what = sys.argv[1]
if what == "setup":
    setup(int(sys.argv[2]), float(sys.argv[3]))
elif what == "step":
    step(sys.argv[2], int(sys.argv[3]))
elif what == "score":
    score()
else:
    rate(float(sys.argv[2]))
"""
INSTALL = "mkdir -p /work && cat > /work/task.py && exec python3 /work/task.py "
SCORE = ["python3", "/work/task.py", "score"]


def last_number(stdout: str) -> float:
    """The number on the last non-empty line (as the daemon reads a score)."""
    return float([line for line in stdout.splitlines() if line.strip()][-1])


def host_busy_secs() -> float:
    """CPU seconds the whole host's processes and kernel spent (all cores; not idle, iowait
    or steal)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_secs() -> float:
    """CPU seconds of this process (the client and the sampler)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def disk_mib(root: Path) -> float:
    """Disk space the files under ``root`` take (allocated blocks)."""
    total = 0
    for d, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, name)).st_blocks * 512
    return total / MIB


class Meter:
    """The daemon's and its QEMUs' CPU, memory and disk over one side of the benchmark.

    CPU: the daemon's own, plus its reaped children's (QEMUs are the daemon's
    children: a killed one's CPU lands in the daemon's ``cutime``/``cstime``),
    plus every live QEMU's, read at the start and the end. Memory: the sum of
    the PSS (and RSS) of the daemon and every QEMU, sampled every
    :data:`SAMPLE_SECS` in a thread, and its peak; also the peak count of QEMUs
    and of the snapshots' disk space.
    """

    def __init__(self, daemon_pid: int, state_dir: Path) -> None:
        self.pid = daemon_pid
        self.state_dir = state_dir
        self.peak = {"pss_mib": 0.0, "rss_mib": 0.0, "qemus": 0, "snapshot_disk_mib": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)

    def cpu(self) -> tuple[float, float]:
        """(daemon's own, QEMUs' and helpers' (live and reaped)) CPU seconds so far."""
        while True:  # a QEMU reaped between the two reads would count twice
            reaped = cpu_secs(self.pid, waited_children=True)
            live = sum(cpu_secs(p) for p in qemu_pids_under(self.state_dir))
            if cpu_secs(self.pid, waited_children=True) == reaped:
                return cpu_secs(self.pid), reaped + live

    def sample(self) -> None:
        pss = rss = 0.0
        qemus = qemu_pids_under(self.state_dir)
        for pid in [self.pid, *qemus]:
            with contextlib.suppress(OSError):
                use = host_processes.memory_usage(pid)
                pss += use.get("pss", 0) / MIB
                rss += use.get("rss", 0) / MIB
        now = {"pss_mib": pss, "rss_mib": rss, "qemus": len(qemus),
               "snapshot_disk_mib": disk_mib(self.state_dir / "snapshots")}  # fmt: skip
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)

    def _sample_loop(self) -> None:
        while not self._stop.wait(SAMPLE_SECS):
            with contextlib.suppress(Exception):  # a sample lost is not the run's failure
                self.sample()

    @contextlib.contextmanager
    def measure(self, into: dict[str, Any]) -> Iterator[None]:
        """Measure the block: wall time, CPU, peaks and the host's other load, into ``into``."""
        load_before = os.getloadavg()[0]
        daemon0, qemus0 = self.cpu()
        busy0, own0, t0 = host_busy_secs(), own_cpu_secs(), time.monotonic()
        self.sample()
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
        self.sample()
        wall = time.monotonic() - t0
        daemon1, qemus1 = self.cpu()
        ours = daemon1 - daemon0 + qemus1 - qemus0
        into.update(
            wall_s=r1(wall), cpu_s=r1(ours), cpu_s_daemon=r1(daemon1 - daemon0),
            cpu_s_qemus=r1(qemus1 - qemus0),
            peak_pss_mib=r1(self.peak["pss_mib"]), peak_rss_mib=r1(self.peak["rss_mib"]),
            peak_qemus=self.peak["qemus"],
            peak_snapshot_disk_mib=r1(self.peak["snapshot_disk_mib"]),
            cpu_s_client=r1(own_cpu_secs() - own0),
            cpu_s_host_others=r1(host_busy_secs() - busy0 - ours - (own_cpu_secs() - own0)),
            load_avg_1m=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        )  # fmt: skip


class ExploreBench(benchlib.DaemonBench):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.choices = CHOICES[: self.args.variants]
        self.calls: list[dict[str, Any]] = []  # one per explore call
        self.leaves: dict[str, float] = {}  # path -> score, from explore
        self.baseline: dict[str, dict[str, Any]] = {}  # path -> what its trajectory did
        self.failed = threading.Event()  # the baseline's other trajectories stop
        self.teardown_ms: dict[str, list[float]] = {"kill": [], "delete_branch": []}
        self.results["_calls"] = self.calls  # finish_results makes the levels of them

    # ------------------------------------------------------------ the task

    def _setup(self, ctl: Controller, sid: str) -> float:
        """Install the task and run its setup in ``sid``: its wall seconds."""
        t0 = time.monotonic()
        secs = self.args.setup_secs
        out = ctl.exec_command(
            sid, ["sh", "-c", f"{INSTALL}setup {self.setup_rounds} {secs}"], stdin=TASK_PY,
            timeout_secs=secs * 10 + 120,
        )  # fmt: skip
        if out["exit_code"] != 0:
            raise RuntimeError(f"setup in {sid} exited {out['exit_code']}: {out['stderr'][-500:]}")
        return time.monotonic() - t0

    def _step(self, choice: str) -> list[str]:
        return ["python3", "/work/task.py", "step", choice, str(self.step_rounds)]

    def calibrate(self, ctl: Controller) -> None:
        """Rounds per second of one guest core (one sandbox, nothing else running): the
        setup's CPU part is sized to --setup-cpu-share of --setup-secs, a step to --step-secs."""
        sid = ctl.spawn_sandboxes(TEMPLATE, n=1)[0]["id"]
        out = ctl.exec_command(sid, ["sh", "-c", f"{INSTALL}rate {CALIBRATE_SECS}"],
                               stdin=TASK_PY, timeout_secs=120)  # fmt: skip
        ctl.kill_sandbox(sid)
        if out["exit_code"] != 0:
            raise RuntimeError(f"calibration exited {out['exit_code']}: {out['stderr'][-500:]}")
        rate = last_number(out["stdout"])
        self.setup_rounds = max(64, round(rate * self.args.setup_secs * self.args.setup_cpu_share))
        self.step_rounds = max(1, round(rate * self.args.step_secs))
        self.results["calibration"] = {
            "rounds_per_s": round(rate), "setup_rounds": self.setup_rounds,
            "step_rounds": self.step_rounds,
            "data_file_mib": round(self.setup_rounds // 64 * 512 / MIB, 2),
        }  # fmt: skip

    # ------------------------------------------------------------ explore side

    def explore_side(self, ctl: Controller) -> None:
        side: dict[str, Any] = {}
        self.say.log("explore: fork a source, run the setup once, explore depth first")
        assert self.daemon.proc is not None
        with Meter(self.daemon.proc.pid, self.daemon.state_dir).measure(side):
            source = ctl.spawn_sandboxes(TEMPLATE, n=1)[0]["id"]
            side["setup_s"] = r1(self._setup(ctl, source))
            t0 = time.monotonic()
            self._explore(ctl, source, "", 1)
            side["search_s"] = r1(time.monotonic() - t0)
        side["explore_calls"] = len(self.calls)
        for what, times in self.teardown_ms.items():  # the client's own, between explores
            if times:
                side[f"{what}_ms_p50"] = r1(percentile(times, 50))
                side[f"{what}_ms_max"] = r1(max(times))
        self.results["explore"] = side

    def _explore(self, ctl: Controller, node: str, path: str, level: int) -> None:
        """Explore ``node`` (at ``path``), kill it, then explore each kept child in turn."""
        last = level == self.args.depth
        t0 = time.monotonic()
        res = ctl.explore_sandbox(
            node, [self._step(c) for c in self.choices], score=SCORE,
            keep=0 if last else len(self.choices), timeout_secs=EXPLORE_TIMEOUT_SECS,
        )  # fmt: skip
        wall_ms = (time.monotonic() - t0) * 1000
        self._timed("kill", ctl.kill_sandbox, node)
        self._record_call(level, res, wall_ms)
        kids = []
        for r in sorted(res.results, key=lambda r: r.index):
            kid_path = path + self.choices[r.index]
            if r.error is not None or r.score is None:
                raise RuntimeError(f"explore of {path or 'the source'}: {kid_path}: {r.error}")
            if r.stdout_tail.strip() != kid_path:
                raise RuntimeError(f"variant {kid_path} printed {r.stdout_tail.strip()!r}")
            if last:
                self.leaves[kid_path] = r.score
            elif not r.kept or r.sandbox_id is None:
                raise RuntimeError(f"explore of {path or 'the source'} did not keep {kid_path}")
            else:
                kids.append((r.sandbox_id, kid_path))
        for kid, kid_path in kids:
            self._explore(ctl, kid, kid_path, level + 1)  # killed there
        if res.branch_kept:  # its children are all gone now
            self._timed("delete_branch", ctl.delete_snapshot, res.branch)

    def _timed(self, what: str, call: Any, arg: str) -> None:
        t0 = time.monotonic()
        call(arg)
        self.teardown_ms[what].append((time.monotonic() - t0) * 1000)

    def _record_call(self, level: int, res: ExploreResult, wall_ms: float) -> None:
        slowest = max(r.duration_ms for r in res.results)
        floor = res.fork_ms + slowest
        self.calls.append({
            "level": level, "wall_ms": r1(wall_ms), "duration_ms": res.duration_ms,
            "pause_ms": res.pause_ms, "fork_ms": res.fork_ms, "slowest_variant_ms": slowest,
            "bound_ms": r1(floor * SLACK), "ratio": round(wall_ms / floor, 3),
            # what the floor leaves out: the branch, the keeping and killing, HTTP
            "other_ms": r1(wall_ms - floor),
        })  # fmt: skip
        self.say.log(f"level {level}: explore {wall_ms:.0f} ms (fork {res.fork_ms:.0f}, "
                     f"slowest variant {slowest:.0f}, ratio {wall_ms / floor:.2f})")  # fmt: skip

    # ------------------------------------------------------------ baseline side

    def baseline_side(self, ctl: Controller) -> None:
        paths = ["".join(p) for p in itertools.product(self.choices, repeat=self.args.depth)]
        workers = self.args.baseline_concurrency or len(self.choices)
        side: dict[str, Any] = {"concurrency": workers, "trajectories": len(paths)}
        self.say.log(f"baseline: {len(paths)} trajectories, each forked and set up, "
                     f"{workers} at once")  # fmt: skip
        assert self.daemon.proc is not None
        with (
            Meter(self.daemon.proc.pid, self.daemon.state_dir).measure(side),
            ThreadPoolExecutor(workers) as pool,
        ):
            for path, run in zip(paths, pool.map(lambda p: self._trajectory(ctl, p), paths),
                                 strict=True):  # fmt: skip
                self.baseline[path] = run
        runs = list(self.baseline.values())
        for key in ("fork_s", "setup_s", "steps_s", "total_s"):
            side[f"{key}_p50"] = r1(percentile([r[key] for r in runs], 50))
            side[f"{key}_max"] = r1(max(r[key] for r in runs))
        self.results["baseline"] = side

    def _trajectory(self, ctl: Controller, path: str) -> dict[str, Any]:
        """One trajectory from scratch: fork, setup, the steps, the score, kill."""
        if self.failed.is_set():
            raise RuntimeError("skipped: another trajectory failed")
        t0 = time.monotonic()
        try:
            sid = ctl.spawn_sandboxes(TEMPLATE, n=1)[0]["id"]
        except BaseException:
            self.failed.set()
            raise
        try:
            run = self._steps(ctl, sid, path, t0)
        except BaseException:
            self.failed.set()
            with contextlib.suppress(Exception):
                ctl.kill_sandbox(sid)
            raise
        ctl.kill_sandbox(sid)
        run["total_s"] = time.monotonic() - t0
        return run

    def _steps(self, ctl: Controller, sid: str, path: str, t0: float) -> dict[str, Any]:
        fork_s = time.monotonic() - t0
        setup_s = self._setup(ctl, sid)
        t1 = time.monotonic()
        for i, choice in enumerate(path):
            out = ctl.exec_command(sid, self._step(choice), timeout_secs=120)
            if out["exit_code"] != 0 or out["stdout"].strip() != path[: i + 1]:
                raise RuntimeError(f"trajectory {path}: step {i + 1} gave {out}")
        out = ctl.exec_command(sid, SCORE, timeout_secs=120)
        if out["exit_code"] != 0:
            raise RuntimeError(f"trajectory {path}: score gave {out}")
        steps_s = time.monotonic() - t1
        return {"score": last_number(out["stdout"]), "fork_s": fork_s, "setup_s": setup_s,
                "steps_s": steps_s}  # fmt: skip

    # ------------------------------------------------------------ the run

    def check(self) -> None:
        """Every leaf's score equals its trajectory's in the baseline: FAIL otherwise."""
        wrong = sorted(p for p, run in self.baseline.items() if self.leaves.get(p) != run["score"])
        self.results["leaves"] = len(self.leaves)
        self.results["leaves_checked"] = len(self.baseline)
        self.results["leaves_mismatched"] = len(wrong)
        if wrong:
            shown = ", ".join(
                f"{p}: explore {self.leaves.get(p)} != baseline {self.baseline[p]['score']}"
                for p in wrong[:5]
            )  # fmt: skip
            self.say.print(f"[red]FAIL[/] {len(wrong)} leaves differ: {shown}")
            self.fail("check", RuntimeError(f"{len(wrong)} leaves differ from the baseline"))

    def _caps(self) -> list[str]:
        """--max-sandboxes and --max-guest-memory raised to fit the run."""
        v, depth = len(self.choices), self.args.depth
        alive = (v - 1) * (depth - 1) + 1 + 2 * v  # pending kids, a node, its variants
        most = max(alive, self.args.baseline_concurrency or v) + 8
        caps = ["--max-sandboxes", str(most), "--max-guest-memory", str(most * self.args.memory)]
        if self.args.pool_size is not None:
            caps += ["--pool-size", str(self.args.pool_size)]
        return caps

    async def kill_all(self) -> None:
        await super().kill_all()
        if self.errors:  # the daemon's log outlives the work dir
            kept = self.workdir.parent / f"{self.workdir.name}.daemon.log"
            with contextlib.suppress(OSError):
                shutil.copy(self.daemon.log, kept)
                self.results["daemon_log"] = str(kept)

    def bench(self) -> None:
        self.results["load_avg_1m_start"] = round(os.getloadavg()[0], 2)
        self.daemon.start(*self._caps())
        self.say.log(f"daemon {self.daemon.url}, building template {TEMPLATE!r}")
        with self.controller(timeout=900) as ctl:
            ctl.create_snapshot(TEMPLATE, image="python", memory_mib=self.args.memory)
            self.calibrate(ctl)
            self.explore_side(ctl)
            self.baseline_side(ctl)
        self.check()
        self.results["load_avg_1m_end"] = round(os.getloadavg()[0], 2)


def level_figures(calls: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per level: its calls' wall time and parts, and the worst wall / (fork + slowest)."""
    levels: dict[str, dict[str, Any]] = {}
    for level in sorted({c["level"] for c in calls}):
        mine = [c for c in calls if c["level"] == level]
        worst = max(c["ratio"] for c in mine)
        levels[str(level)] = {
            "calls": len(mine),
            **{f"{key}_p50": r1(percentile([c[key] for c in mine], 50))
               for key in ("wall_ms", "fork_ms", "slowest_variant_ms", "other_ms", "pause_ms")
               if all(c[key] is not None for c in mine)},
            "wall_ms_max": max(c["wall_ms"] for c in mine),
            "worst_ratio": worst,
            "within": worst <= SLACK,
        }  # fmt: skip
    return levels


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results.update(
        setup_secs=args.setup_secs, setup_cpu_share=args.setup_cpu_share,
        step_secs=args.step_secs, depth=args.depth, variants=args.variants,
        memory_mib=args.memory, host_cores=os.cpu_count(),
    )  # fmt: skip
    calls = results.pop("_calls", [])
    if calls:
        results["levels"] = level_figures(calls)
        results["per_level_worst_ratio"] = max(c["ratio"] for c in calls)
        results["calls"] = calls
    ex, base = results.get("explore"), results.get("baseline")
    if ex and base:
        results["explore_speedup"] = round(base["wall_s"] / ex["wall_s"], 2)
        results["cpu_ratio"] = round(base["cpu_s"] / max(ex["cpu_s"], 0.1), 2)
        results["peak_pss_ratio"] = round(base["peak_pss_mib"] / max(ex["peak_pss_mib"], 1), 2)
    results["targets"] = judge(results, TARGETS)
    return results


SIDE_ROWS = ("wall_s", "cpu_s", "cpu_s_daemon", "cpu_s_qemus", "peak_pss_mib", "peak_rss_mib",
             "peak_qemus", "peak_snapshot_disk_mib", "cpu_s_host_others",
             "load_avg_1m")  # fmt: skip


def render(out: Console, bench: ExploreBench, res: dict[str, Any]) -> None:
    title = (
        f"forkd explore: depth {res['depth']} x {res['variants']} variants, setup "
        f"{res['setup_secs']:g} s ({res.get('accel')}, {res['host_cores']} cores)"
    )
    t = benchlib.targets_table(title, res["targets"])
    for key in ("cpu_ratio", "peak_pss_ratio", "leaves", "leaves_mismatched"):
        t.add_row(key, str(res.get(key)), "", "")
    for level, fig in (res.get("levels") or {}).items():
        t.add_row(f"level {level}: {fig['calls']} calls, wall p50 / max ms",
                  f"{fig.get('wall_ms_p50')} / {fig['wall_ms_max']}",
                  f"ratio <= {SLACK:g}", benchlib.MET_MARK[fig["within"]])  # fmt: skip
        t.add_row("  fork / slowest variant / other p50 ms",
                  f"{fig.get('fork_ms_p50')} / {fig.get('slowest_variant_ms_p50')} / "
                  f"{fig.get('other_ms_p50')}", f"worst {fig['worst_ratio']}", "")  # fmt: skip
    out.print(t)
    sides = Table(title="each side")
    for col in ("figure", "explore", "baseline"):
        sides.add_column(col)
    ex, base = res.get("explore") or {}, res.get("baseline") or {}
    for key in (*SIDE_ROWS, "setup_s", "search_s", "explore_calls", "kill_ms_p50",
                "delete_branch_ms_p50", "concurrency", "setup_s_p50", "setup_s_max",
                "steps_s_p50", "total_s_p50"):  # fmt: skip
        sides.add_row(key, str(ex.get(key, "")), str(base.get(key, "")))
    out.print(sides)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup-secs", type=float, default=20.0, help="the setup's length (20)")
    p.add_argument("--setup-cpu-share", type=float, default=0.5,
                   help="of it, CPU work building a data file; the rest sleeps (0.5)")  # fmt: skip
    p.add_argument("--step-secs", type=float, default=0.5, help="CPU work per step (0.5)")
    p.add_argument("--depth", type=int, default=3, help="levels of the search (3)")
    p.add_argument("--variants", type=int, default=4, help="variants per level (4)")
    p.add_argument("--baseline-concurrency", type=int, default=0,
                   help="trajectories at once (0: --variants, as an explore runs)")  # fmt: skip
    p.add_argument("--pool-size", type=int, help="the daemon's --pool-size (its default)")
    p.add_argument("--memory", type=int, default=256, help="template RAM in MiB (256)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if not (args.setup_secs > 0 and 0 <= args.setup_cpu_share <= 1 and args.step_secs > 0
            and 1 <= args.depth <= 5 and 1 <= args.variants <= 10
            and args.variants**args.depth <= 1000
            and args.baseline_concurrency >= 0):  # fmt: skip
        p.error(
            "--setup-secs and --step-secs must be > 0, --setup-cpu-share 0..1, --depth "
            "1..5, --variants 1..10 (at most 1000 leaves), --baseline-concurrency >= 0"
        )
    return benchlib.run_main(
        benchlib.amain(args, ExploreBench, finish_results, render, workdir_prefix="forkd-explore-")
    )


if __name__ == "__main__":
    sys.exit(main())
