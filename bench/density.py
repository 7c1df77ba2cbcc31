"""Density benchmark: how many idle children a host holds with the daemon's defaults,
then memory pressure that makes reclaim hibernate some, and requests that wake them.

Run from the repository root::

    python bench/density.py                 # table on stdout, then one JSON line
    python bench/density.py --json-only     # only the JSON line

It starts its own ``forkd serve`` with no flag but its state dir (the default
admission caps, reserve, watermarks and ``--reclaim-idle``, unless ``--reclaim-idle``
is given here), builds a 256 MiB template of the ``python`` image, and measures
through the SDK:

1. ``idle_children``: forks ``--batch`` children a request until the daemon says
   429 or ``--max`` run; each one's guest writes a marker file. Then the host's
   memory and CPU at that point (``host_available_mib``, ``idle_cpu_pct_of_one_core``
   over ``--sample-secs``) and each child's own memory (``own_mib_p50``).
2. Pressure: a random quarter of the children (``--seed``) each hold
   ``--touch-mib`` MiB written in their guest, one after the other, paced so that
   the host never falls under the reserve: reclaim hibernates idle children
   (``evictions``, from the daemon's ``hibernated`` events with reason ``memory``).
3. Wakes: an exec in each hibernated child (at most ``--wakes``), which wakes it:
   ``wake_ms_p50``/``p99`` from the answers' ``Forkd-Wake-Ms`` header.
4. ``lost``: children that are gone, dead, or no longer hold their marker (every
   child is checked at the end): must be 0.

The daemon and every VM are killed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from forkd.client import Controller, ControllerError
from forkd.controller.services.host_memory import read_meminfo
from forkd.vmm.qemu import host_processes
from forkd.vmm.qemu.host_processes import qemu_pids_under

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
import benchlib
from benchlib import MIB, cpu_secs, judge, percentile, r1

TEMPLATE = "density-bench"
EXEC_THREADS = 4
MARKER = "/root/density-marker"
TARGETS = {  # name: (metric key, comparison, bound)
    "idle_children": ("idle_children", ">=", 300),
    "wake_ms_p50": ("wake_ms_p50", "<=", 1000.0),
    "lost": ("lost", "<=", 0),
}
# Touch no more while the host has less than this over the reserve: reclaim catches up.
PACING_MARGIN_MIB = 768


class DensityBench(benchlib.DaemonBench):
    def bench(self) -> None:
        idle = self.args.reclaim_idle
        self.daemon.start(*([] if idle is None else ["--reclaim-idle", str(idle)]))
        self.say.log(f"daemon {self.daemon.url}, building template {TEMPLATE!r}")
        with self.controller(timeout=900) as ctl:
            capacity = httpx.get(f"{self.daemon.url}/v1/capacity", headers=self._auth()).json()
            self.results.update(max_sandboxes=capacity.get("max_sandboxes"),
                                memory_reserve_mib=capacity.get("memory_reserve_mib"))  # fmt: skip
            ctl.create_snapshot(TEMPLATE, image="python", memory_mib=256)
            kids = self.fill(ctl)
            self.sample(kids)
            self.press(ctl, kids)
            self.wake(ctl, kids)
            self.check(ctl, kids)

    # ---------------------------------------------------------------- 1. fill

    def fill(self, ctl: Controller) -> list[str]:
        kids: list[str] = []
        t0 = time.monotonic()
        while len(kids) < self.args.max:
            n = min(self.args.batch, self.args.max - len(kids))
            try:
                made = [k["id"] for k in ctl.spawn_sandboxes(TEMPLATE, n=n)]
            except ControllerError as exc:
                if exc.status != 429:
                    raise
                self.results["refused_with"] = str(exc)[:400]
                self.say.log(f"429 at {len(kids)} children: {exc}")
                break
            with ThreadPoolExecutor(EXEC_THREADS) as pool:
                list(pool.map(lambda k: self._mark(ctl, k), made))
            kids += made
            self.say.log(f"{len(kids)} children, {read_meminfo().available_mib} MiB available")
        states = self._states(ctl)
        self.results["idle_children"] = sum(1 for s in states.values() if s == "running")
        self.results["forked"] = len(kids)
        self.results["hibernated_while_filling"] = list(states.values()).count("hibernated")
        self.results["fill_s"] = r1(time.monotonic() - t0)
        return kids

    def _mark(self, ctl: Controller, sandbox_id: str) -> None:
        out = ctl.exec_command(sandbox_id, ["sh", "-c", f"echo {sandbox_id} > {MARKER}"])
        if out["exit_code"] != 0:
            raise RuntimeError(f"{sandbox_id} could not write its marker: {out}")

    def sample(self, kids: list[str]) -> None:
        """The host with every child idle: memory, CPU, each child's own memory."""
        time.sleep(self.args.settle_secs)
        assert self.daemon.proc is not None
        pids = qemu_pids_under(self.daemon.state_dir)
        before = sum(cpu_secs(p) for p in pids) + cpu_secs(self.daemon.proc.pid)
        t0 = time.monotonic()
        time.sleep(self.args.sample_secs)
        used = sum(cpu_secs(p) for p in pids) + cpu_secs(self.daemon.proc.pid) - before
        own = [host_processes.resident_memory(p).get("anon", 0) / MIB for p in pids]
        host = read_meminfo()
        self.results.update(
            idle_cpu_pct_of_one_core=r1(100 * used / (time.monotonic() - t0)),
            own_mib_p50=r1(percentile(own, 50)),
            own_mib_total=round(sum(own)),
            host_available_mib=host.available_mib,
            host_total_mib=host.total_mib,
        )

    # ---------------------------------------------------------------- 2. pressure

    def press(self, ctl: Controller, kids: list[str]) -> None:
        rng = random.Random(self.args.seed)
        chosen = rng.sample(kids, max(1, len(kids) // 4))
        reserve = int(self.results.get("memory_reserve_mib") or 1024)
        hold = (f"import time\nb = bytearray({self.args.touch_mib} << 20)\n"
                "b[::4096] = b'x' * len(b[::4096])\nprint('held', flush=True)\n"
                "time.sleep(1e6)")  # fmt: skip
        t0 = time.monotonic()
        touched = 0
        for i, sid in enumerate(chosen):
            while read_meminfo().available_mib < reserve + PACING_MARGIN_MIB + self.args.touch_mib:
                if time.monotonic() - t0 > self.args.press_secs:
                    break
                time.sleep(1)  # reclaim hibernates idle children meanwhile
            else:
                touched += 1
            if time.monotonic() - t0 > self.args.press_secs:
                self.say.log("the pressure phase ran out of time: no more children touched")
                break
            try:
                self._hold(ctl, sid, hold)
            except (ControllerError, TimeoutError) as exc:
                self.say.log(f"touching memory in {sid}: {exc}")
            if i % 10 == 9:
                self.say.log(f"{i + 1} of {len(chosen)} hold {self.args.touch_mib} MiB; "
                             f"{read_meminfo().available_mib} MiB available")  # fmt: skip
        time.sleep(self.args.settle_secs)
        states = self._states(ctl)
        saved = sorted(self.daemon.state_dir.glob("snapshots/.hibernated.*"))
        disk = [sum(benchlib.allocated_mib(f) for f in d.iterdir()) for d in saved]
        self.results.update(
            touched=touched,
            hibernated_disk_mib_p50=r1(percentile(disk, 50)) if disk else None,
            press_s=r1(time.monotonic() - t0),
            evictions=sum(1 for s in states.values() if s == "hibernated"),
            available_after_press_mib=read_meminfo().available_mib,
        )
        metrics = httpx.get(f"{self.daemon.url}/metrics", headers=self._auth()).text
        for line in metrics.splitlines():
            if line.startswith("forkd_evictions_total "):
                self.results["evictions_total"] = int(float(line.split()[1]))

    def _hold(self, ctl: Controller, sandbox_id: str, hold: str) -> None:
        """Start the holding process and wait until its memory is written (it says so):
        the next one is started only once the host feels this one."""
        pid = ctl.start_process(sandbox_id, ["python3", "-c", hold])["pid"]
        deadline = time.monotonic() + 120
        while not ctl.get_process(sandbox_id, pid).get("output_end"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sandbox_id}: its memory was not written in 120 s")
            time.sleep(0.2)

    # ---------------------------------------------------------------- 3. wakes

    def wake(self, ctl: Controller, kids: list[str]) -> None:
        sleeping = [sid for sid, s in self._states(ctl).items() if s == "hibernated"]
        waits: list[float] = []
        walls: list[float] = []
        with httpx.Client(base_url=self.daemon.url, headers=self._auth(), timeout=300) as http:
            for sid in sleeping[: self.args.wakes]:
                t0 = time.monotonic()
                r = http.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["cat", MARKER]})
                walls.append((time.monotonic() - t0) * 1000)
                if r.status_code != 200 or r.json()["stdout"].strip() != sid:
                    raise RuntimeError(f"waking {sid}: {r.status_code} {r.text[:300]}")
                waits.append(float(r.headers.get("forkd-wake-ms", 0)))
        self.results.update(
            woken=len(waits),
            wake_ms_p50=r1(percentile(waits, 50)) if waits else None,
            wake_ms_p99=r1(percentile(waits, 99)) if waits else None,
            wake_exec_wall_ms_p50=r1(percentile(walls, 50)) if walls else None,
        )

    # ---------------------------------------------------------------- 4. nothing lost

    def check(self, ctl: Controller, kids: list[str]) -> None:
        states = self._states(ctl)
        lost = [sid for sid in kids if states.get(sid) not in ("running", "paused", "hibernated")]
        awake = [sid for sid in kids if states.get(sid) == "running"]

        def holds_marker(sid: str) -> bool:
            out = ctl.exec_command(sid, ["cat", MARKER])
            return bool(out["exit_code"] == 0 and out["stdout"].strip() == sid)

        with ThreadPoolExecutor(EXEC_THREADS) as pool:
            held = list(pool.map(holds_marker, awake))
        lost += [sid for sid, ok in zip(awake, held, strict=True) if not ok]
        self.results["lost"] = len(lost)
        every = list(states.values())
        self.results["states_at_end"] = {s: every.count(s) for s in set(every)}
        if lost:
            self.results["lost_ids"] = lost[:20]

    def _states(self, ctl: Controller) -> dict[str, str]:
        return {s["id"]: s["state"] for s in ctl.list_sandboxes()}

    def _auth(self) -> dict[str, str]:
        token = self.daemon.token_path.read_text().strip()
        return {"Authorization": f"Bearer {token}"}


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["targets"] = judge(results, TARGETS)
    results["host_cores"] = os.cpu_count()
    results["touch_mib"] = args.touch_mib
    return results


def render(out: Console, bench: DensityBench, res: dict[str, Any]) -> None:
    title = f"forkd density ({res.get('accel')}, {res['host_cores']} cores)"
    t = benchlib.targets_table(title, res["targets"])
    for key in ("max_sandboxes", "memory_reserve_mib", "fill_s", "refused_with",
                "own_mib_p50", "own_mib_total", "host_total_mib", "host_available_mib",
                "idle_cpu_pct_of_one_core", "touched", "press_s", "evictions",
                "evictions_total", "available_after_press_mib", "hibernated_disk_mib_p50",
                "forked", "hibernated_while_filling", "woken", "wake_ms_p99",
                "wake_exec_wall_ms_p50", "states_at_end"):  # fmt: skip
        t.add_row(key, str(res.get(key)), "", "")
    out.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max", type=int, default=600, help="children at most (600)")
    p.add_argument("--batch", type=int, default=20, help="children a fork request (20)")
    p.add_argument("--settle-secs", type=int, default=15, help="before sampling (15)")
    p.add_argument("--sample-secs", type=int, default=30, help="CPU sampled this long (30)")
    p.add_argument("--touch-mib", type=int, default=128, help="MiB each touched child holds")
    p.add_argument("--press-secs", type=int, default=900, help="pressure phase at most (900)")
    p.add_argument("--wakes", type=int, default=50, help="hibernated children woken (50)")
    p.add_argument("--reclaim-idle", type=float, default=None,
                   help="the daemon's --reclaim-idle (default: the daemon's own)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="which quarter is touched (1)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.max < 1 or not 1 <= args.batch <= 100 or args.touch_mib < 1:
        p.error("--max at least 1, --batch 1..100, --touch-mib at least 1")
    return benchlib.run_main(
        benchlib.amain(args, DensityBench, finish_results, render, workdir_prefix="forkd-density-")
    )


if __name__ == "__main__":
    sys.exit(main())
