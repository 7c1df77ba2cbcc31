"""Soak benchmark: a daemon under CPU load forks, branches and execs at length, and leaks nothing.

Run from the repository root::

    python bench/soak.py                                       # 1000 forks, 100 branches, 500 execs
    python bench/soak.py --forks 150 --branches 20 --execs 80  # a shorter run

It starts its own ``forkd serve`` (a temporary state dir, the daemon's default
caps) and ``--burners`` CPU-burning processes, builds 3 templates, runs the
forks (batches of 1-10), branches and execs shuffled by ``--seed``, killing
children as it goes, then deletes everything through the API, stops the
daemon and counts what is left of it (``bench/leaks.py``). bench/README.md
says what each figure is. Failures and leaks must be 0: the exit status is 1
otherwise. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd.client import Controller, ControllerError
from forkd.launcher import DaemonProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
import benchlib
import leaks
from benchlib import percentile, r1


@dataclass(frozen=True)
class Template:
    tag: str
    warmup: str
    marker_path: str  # a file holding the tag, written at setup
    volume: str | None = None  # attached at /mnt/data


@dataclass(frozen=True)
class Child:
    id: str
    template: Template  # whose marker it must have


@dataclass(eq=False)
class Branch:
    tag: str
    template: Template
    forking: int = 0  # forks from it in flight: it is not deleted meanwhile


@dataclass(eq=False)
class Population:
    """The running children and the recent branches, shared by the workers.

    A child is idle or checked out by one worker; only idle children are
    branched, exec'd or killed, so no two operations race on one child (that
    race would be the benchmark's failure, not the daemon's). ``slots`` counts
    children running plus children being forked, kept at or under ``cap``.
    """

    cap: int
    keep_branches: int = 4
    templates: list[Template] = field(default_factory=list)
    idle: dict[str, Child] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)  # oldest first
    slots: int = 0
    peak: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def running(self) -> int:
        with self.cond:
            return self.slots

    def reserve(self, n: int, rng: random.Random) -> list[Child]:
        """Hold room for ``n`` children: [] once held, else idle children to kill first."""
        with self.cond:
            while True:
                over = self.slots + n - self.cap
                if over <= 0:
                    self.slots += n
                    self.peak = max(self.peak, self.slots)
                    return []
                if self.idle:
                    ids = rng.sample(sorted(self.idle), min(over, len(self.idle)))
                    return [self.idle.pop(i) for i in ids]
                self.cond.wait(0.5)  # every child is busy: one will be back

    def add(self, children: list[Child], held: int) -> None:
        with self.cond:
            self.idle.update((c.id, c) for c in children)
            self.slots -= held - len(children)
            self.cond.notify_all()

    def release(self, n: int) -> None:
        with self.cond:
            self.slots -= n
            self.cond.notify_all()

    def checkout(self, rng: random.Random, wait: float = 30.0) -> Child | None:
        """An idle child, or None when none runs (or none came back within ``wait``)."""
        deadline = time.monotonic() + wait
        with self.cond:
            while not self.idle:
                if self.slots == 0 or time.monotonic() >= deadline:
                    return None
                self.cond.wait(0.5)
            return self.idle.pop(rng.choice(sorted(self.idle)))

    def checkin(self, child: Child) -> None:
        with self.cond:
            self.idle[child.id] = child
            self.cond.notify_all()

    def pick_source(self, rng: random.Random) -> tuple[str, Template, Branch | None]:
        """A template, or one time in four a recent branch (held until :meth:`done_with`)."""
        with self.cond:
            if self.branches and rng.random() < 0.25:
                b = rng.choice(self.branches)
                b.forking += 1
                return b.tag, b.template, b
            t = rng.choice(self.templates)
            return t.tag, t, None

    def done_with(self, branch: Branch | None) -> None:
        if branch is not None:
            with self.cond:
                branch.forking -= 1

    def add_branch(self, tag: str, template: Template) -> list[str]:
        """Note a new branch; returns the oldest ones to delete, none being forked."""
        with self.cond:
            self.branches.append(Branch(tag, template))
            doomed = []
            while len(self.branches) > self.keep_branches:
                free = next((b for b in self.branches if b.forking == 0), None)
                if free is None:
                    break
                self.branches.remove(free)
                doomed.append(free.tag)
            return doomed


VOLUME = "soakvol"
TEMPLATES = (
    Template("soak-a", "x = 'a'", "/work/tpl.txt"),
    Template("soak-b", "import json, re\nx = 'b'", "/work/tpl.txt"),
    # 8 MiB of dirty heap, and its marker on a volume (a layer per fork and branch).
    Template("soak-c", "blob = bytearray(8 << 20)\nx = 'c'", "/mnt/data/tpl.txt", VOLUME),
)
CHECK = "import sys; print(open(sys.argv[1]).read().strip(), sys.argv[2])"
KILL_AFTER_EXEC = 0.1  # chance that a child is killed after an exec, beyond what room needs
MIN_RUNNING = 4  # ... unless fewer run
DEFAULT_RUNNING = 16  # children at once: the daemon's old per-core default on 2 cores
PROGRESS_EVERY = 50  # operations
TIMES = {  # what is timed: its label in the table
    "fork_wall_ms": "fork batch (1-10), client wall",
    "fork_ms": "fork, daemon's fork_ms",
    "branch_wall_ms": "branch, client wall",
    "pause_ms": "branch, daemon's pause_ms",
    "exec_wall_ms": "exec, client wall",
    "kill_wall_ms": "kill, client wall",
}


class Soak(benchlib.BenchBase):
    """The soak run: the daemon, the workers that drive it, the clean-up and the census."""

    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.daemon = DaemonProcess(workdir / "state")
        self.burners: list[subprocess.Popen[bytes]] = []
        self.stopping = threading.Event()
        self.pop = Population(args.max_running or DEFAULT_RUNNING)
        self.failures: list[dict[str, str]] = []
        self.times: dict[str, list[float]] = {k: [] for k in TIMES}
        self.counts = {"forks": 0, "fork_batches": 0, "refill_forks": 0, "branches": 0,
                       "execs": 0, "kills": 0, "snapshot_deletes": 0}  # fmt: skip
        self._lock = threading.Lock()  # failures, times, counts, the plan
        self._done = 0

    # -------------------------------------------------------------- recording

    def failed(self, op: str, what: str, exc: BaseException | str) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.failures.append({"op": op, "what": what, "error": error})
        self.say.log(f"[red]failed:[/] {op} {what}: {error}")

    def record(self, key: str, *values: float) -> None:
        with self._lock:
            self.times[key].extend(values)

    def bump(self, key: str, by: int = 1) -> None:
        with self._lock:
            self.counts[key] += by

    def controller(self) -> Controller:
        return Controller(self.daemon.url, token_file=self.daemon.token_path, timeout=180)

    # -------------------------------------------------------------- operations

    def kill(self, ctl: Controller, child: Child) -> None:
        t0 = time.monotonic()
        try:
            ctl.kill_sandbox(child.id)
        except ControllerError as exc:  # its slot stays held: the daemon may still count it
            self.failed("kill", child.id, exc)
            return
        self.record("kill_wall_ms", (time.monotonic() - t0) * 1000)
        self.bump("kills")
        self.pop.release(1)

    def fork(self, ctl: Controller, n: int, rng: random.Random, *, refill: bool = False) -> None:
        while victims := self.pop.reserve(n, rng):
            for child in victims:
                self.kill(ctl, child)
        tag, template, branch = self.pop.pick_source(rng)
        what = f"{n} from {tag}"
        t0 = time.monotonic()
        try:
            infos = ctl.spawn_sandboxes(tag, n=n)
        except ControllerError as exc:
            self.pop.release(n)
            self.failed("fork", what, exc)
            return
        finally:
            self.pop.done_with(branch)
        self.record("fork_wall_ms", (time.monotonic() - t0) * 1000)
        self.record("fork_ms", *(i["fork_ms"] for i in infos if i.get("fork_ms") is not None))
        self.bump("refill_forks" if refill else "forks", len(infos))
        self.bump("fork_batches")
        bad = [i["id"] for i in infos if i.get("state") != "running"]
        if len(infos) != n or bad:
            self.failed("fork", what, f"got {len(infos)} sandboxes, not running: {bad}")
        self.pop.add([Child(i["id"], template) for i in infos], held=n)

    def checkout(self, ctl: Controller, rng: random.Random) -> Child:
        """An idle running child; one is forked when none runs or will soon."""
        while (child := self.pop.checkout(rng)) is None:
            self.fork(ctl, 1, rng, refill=True)
        return child

    def branch(self, ctl: Controller, _n: int, rng: random.Random) -> None:
        child = self.checkout(ctl, rng)
        t0 = time.monotonic()
        try:
            info = ctl.branch_sandbox(child.id)
        except ControllerError as exc:
            self.failed("branch", child.id, exc)
            self.pop.checkin(child)
            return
        self.record("branch_wall_ms", (time.monotonic() - t0) * 1000)
        if info.get("pause_ms") is not None:
            self.record("pause_ms", info["pause_ms"])
        self.bump("branches")
        self.pop.checkin(child)
        for old in self.pop.add_branch(info["tag"], child.template):
            try:
                ctl.delete_snapshot(old)
                self.bump("snapshot_deletes")
            except ControllerError as exc:
                self.failed("delete-snapshot", old, exc)

    def exec(self, ctl: Controller, _n: int, rng: random.Random) -> None:
        child = self.checkout(ctl, rng)
        nonce = f"{rng.getrandbits(48):012x}"
        path = child.template.marker_path
        t0 = time.monotonic()
        try:
            res = ctl.exec_command(child.id, ["python3", "-c", CHECK, path, nonce])
        except ControllerError as exc:
            self.failed("exec", child.id, exc)
            self.kill(ctl, child)  # it may be dead: make room for a live one
            return
        self.record("exec_wall_ms", (time.monotonic() - t0) * 1000)
        self.bump("execs")
        want = f"{child.template.tag} {nonce}\n"
        if res.get("exit_code") != 0 or res.get("stdout") != want:
            self.failed("exec", child.id, f"wanted {want!r}, got {res!r}")
        if rng.random() < KILL_AFTER_EXEC and self.pop.running() > MIN_RUNNING:
            self.kill(ctl, child)
        else:
            self.pop.checkin(child)

    # -------------------------------------------------------------- the run

    def plan(self) -> list[tuple[str, int]]:
        """The operations, shuffled by ``--seed``; a fork first."""
        rng = random.Random(self.args.seed)
        batches, left = [], self.args.forks
        while left > 0:
            batches.append(min(left, rng.randint(1, 10)))
            left -= batches[-1]
        ops = [("fork", b) for b in batches]
        ops += [("branch", 0)] * self.args.branches + [("exec", 0)] * self.args.execs
        rng.shuffle(ops)
        first = next((i for i, op in enumerate(ops) if op[0] == "fork"), 0)
        ops.insert(0, ops.pop(first))
        return ops

    def worker(self, ops: list[tuple[str, int]]) -> None:
        with self.controller() as ctl:
            while not self.stopping.is_set():
                with self._lock:
                    if self._done >= len(ops):
                        return
                    i = self._done
                    self._done += 1
                kind, n = ops[i]
                rng = random.Random(f"{self.args.seed}:{i}")
                try:
                    getattr(self, kind)(ctl, n, rng)
                except Exception as exc:  # the benchmark's own bug: still a failure
                    self.failed(kind, f"op {i}", exc)
                if (i + 1) % PROGRESS_EVERY == 0:
                    self.say.log(
                        f"{i + 1}/{len(ops)} operations, {self.pop.running()} running, "
                        f"{len(self.failures)} failures"
                    )

    def build_templates(self, ctl: Controller) -> None:
        ctl.create_volume(VOLUME, "16M")
        for t in TEMPLATES:
            t0 = time.monotonic()
            write = f"mkdir -p {os.path.dirname(t.marker_path)} && echo {t.tag} > {t.marker_path}"
            extra: dict[str, Any] = (
                {"volumes": [{"name": t.volume, "path": "/mnt/data"}]} if t.volume else {}
            )
            ctl.create_snapshot(t.tag, image="python", memory_mib=256, warmup=t.warmup,
                                setup=["mkdir -p /work", write], **extra)  # fmt: skip
            self.results.setdefault("template_build_s", {})[t.tag] = round(time.monotonic() - t0, 1)
        self.pop.templates = list(TEMPLATES)

    def start(self) -> None:
        self.veths_before = leaks.host_veths()
        for _ in range(self.args.burners):
            self.burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        extra = ["--max-sandboxes", str(self.args.max_running)] if self.args.max_running else []
        self.daemon.start(*extra)
        prefix = leaks.id_prefix(self.daemon.state_dir)
        if prefix is None:
            raise SystemExit("the daemon started but its registry has no VM id prefix")
        self.prefix = prefix
        self.say.log(f"daemon {self.daemon.url} (VM ids sb-{self.prefix}-*), "
                     f"{len(self.burners)} CPU burners")  # fmt: skip

    def soak(self) -> None:
        self.start()
        with self.controller() as ctl:
            self.build_templates(ctl)
            ops = self.plan()
            t0 = time.monotonic()
            threads = [
                threading.Thread(target=self.worker, args=(ops,), name=f"soak-{w}")
                for w in range(self.args.workers)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.results["mix_secs"] = round(time.monotonic() - t0, 1)
            if not self.stopping.is_set():
                self.clean_up(ctl)
        if not self.stopping.is_set():
            self.count_leaks()

    def clean_up(self, ctl: Controller) -> None:
        """Delete every sandbox, snapshot and the volume through the API, then stop the daemon."""
        for sb in ctl.list_sandboxes():
            self.kill(ctl, Child(sb["id"], TEMPLATES[0]))
        for snap in sorted(ctl.list_snapshots(), key=lambda s: s.get("parent_tag") is None):
            try:  # branches first, templates last
                ctl.delete_snapshot(snap["tag"])
            except ControllerError as exc:
                self.failed("delete-snapshot", snap["tag"], exc)
        # Layers are counted before the volume goes: deleting it would hide them.
        self.layers_left = leaks.take_census(self.daemon.state_dir, self.prefix).volume_layers
        try:
            ctl.delete_volume(VOLUME)
        except ControllerError as exc:
            self.failed("delete-volume", VOLUME, exc)
        left = [s["id"] for s in ctl.list_sandboxes()] + [s["tag"] for s in ctl.list_snapshots()]
        if left:
            self.failed("clean-up", "the daemon still lists", ", ".join(left))
        self.daemon.stop()  # SIGTERM: a sandbox it still had would be left running, a leak
        time.sleep(0.5)  # QEMUs it killed leave their namespaces and groups

    def count_leaks(self) -> None:
        census = leaks.take_census(self.daemon.state_dir, self.prefix)
        census.volume_layers |= self.layers_left
        veths = leaks.new_veths(self.veths_before, leaks.host_veths(), census.foreign_netns)
        counts = {**census.counts(), "veths": len(veths)}
        self.results["leaks"] = counts
        self.results["leaks_total"] = sum(counts.values())
        names = census.names()
        names["veths"] = sorted(v.name for v in veths)
        self.results["leaked"] = {k: v for k, v in names.items() if v}

    async def run(self) -> None:
        self.results["seed"] = self.args.seed
        try:
            await asyncio.to_thread(self.soak)
        finally:
            self.summarise()

    def summarise(self) -> None:
        res = self.results
        res.update(self.counts)
        res["workers"], res["burners"] = self.args.workers, self.args.burners
        res["max_running"], res["peak_running"] = self.pop.cap, self.pop.peak
        for key, values in self.times.items():
            if values:
                res[key] = {"p50": r1(percentile(values, 50)), "p99": r1(percentile(values, 99)),
                            "n": len(values)}  # fmt: skip
        res["failures"] = len(self.failures)
        res["failure_list"] = self.failures
        if self.failures:
            self.errors.append(f"{len(self.failures)} operations failed")
        if res.get("leaks_total"):
            self.errors.append(f"leaked: {res['leaked']}")
        if self.errors or self.failures:
            kept = self.workdir.parent / f"{self.workdir.name}.daemon.log"
            with contextlib.suppress(OSError):
                shutil.copy(self.daemon.log, kept)
                res["daemon_log"] = str(kept)

    async def kill_all(self) -> None:
        """Whatever happened: the daemon, its VMs and namespaces, and the burners go."""
        self.stopping.set()
        await asyncio.to_thread(self._kill_all)

    def _kill_all(self) -> None:
        with contextlib.suppress(Exception):
            self.daemon.stop(signal.SIGKILL)
        leaks.remove_leftovers(self.daemon.state_dir, leaks.id_prefix(self.daemon.state_dir))
        for p in self.burners:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ report


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["host_cores"] = os.cpu_count()
    results["ok"] = results.get("failures") == 0 and results.get("leaks_total") == 0
    return results


def render(out: Console, bench: Soak, res: dict[str, Any]) -> None:
    t = Table(title=f"forkd soak ({res['host_cores']} cores, {res['burners']} CPU burners)")
    for col, justify in (("figure", "left"), ("p50", "right"), ("p99", "right"), ("n", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for key, label in TIMES.items():
        if key in res:
            v = res[key]
            t.add_row(label, f"{v['p50']} ms", f"{v['p99']} ms", str(v["n"]))
    out.print(t)
    counts = ", ".join(f"{k} {res.get(k)}" for k in bench.counts)
    out.print(f"{counts}; peak running {res['peak_running']} of {res['max_running']}")
    colour = "green" if res.get("failures") == 0 else "red"
    out.print(f"[{colour}]failures: {res.get('failures')}[/]")
    for f in res.get("failure_list", []):
        out.print(f"  {f['op']} {f['what']}: {f['error']}", markup=False)
    if "leaks" in res:
        colour = "green" if res["leaks_total"] == 0 else "red"
        out.print(f"[{colour}]leaks: {res['leaks_total']}[/] " + ", ".join(
            f"{k} {v}" for k, v in res["leaks"].items()))  # fmt: skip
        for kind, names in res.get("leaked", {}).items():
            out.print(f"  {kind}: {', '.join(names)}", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--forks", type=int, default=1000, help="children forked in all (1000)")
    p.add_argument("--branches", type=int, default=100, help="branches of running children (100)")
    p.add_argument("--execs", type=int, default=500, help="execs in running children (500)")
    p.add_argument("--seed", type=int, default=1, help="shuffles the operations (1)")
    p.add_argument("--workers", type=int, default=3, help="clients sending at once (3)")
    p.add_argument("--burners", type=int, default=2, help="CPU-burning processes (2)")
    p.add_argument("--max-running", type=int, default=None,
                   help="children at once; given, it is the daemon's --max-sandboxes too "
                   f"(default: {DEFAULT_RUNNING}, the daemon's own default then)")  # fmt: skip
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if min(args.forks, args.workers) < 1 or min(args.branches, args.execs, args.burners) < 0:
        p.error("--forks and --workers must be at least 1, the other counts at least 0")
    if args.max_running is not None and args.max_running < 10:
        p.error("--max-running must be at least 10 (a fork batch is up to 10)")
    return benchlib.run_main(
        benchlib.amain(args, Soak, finish_results, render, workdir_prefix="forkd-soak-")
    )


if __name__ == "__main__":
    sys.exit(main())
