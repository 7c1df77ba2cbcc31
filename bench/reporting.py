"""What the daemon's reporting out costs: webhooks and OpenTelemetry beside neither.

Run from the repository root::

    python bench/reporting.py            # table on stdout, then one JSON line
    python bench/reporting.py --json-only

It starts two daemons on this host, each with a template of the ``python`` image:
``plain`` with neither, and ``reporting`` with ``--otlp-endpoint`` and ten webhooks
taking every event, both sent to a sink on loopback that takes everything (spans
every 200 ms, metrics every second: busier than the defaults). Then:

1. ``fork_ms``: one child forked and answered, then killed (not timed), ``--samples``
   times on each daemon, alternating, so load and cache effects fall on both alike,
   each fork a second after the last kill (the warm pool refilled, the last
   deliveries sent): the p50 of each and ``ratio`` = reporting's / plain's.
   ``cold_fork_ms``: the same with a memory limit, which keeps forks off the warm pool:
   every fork restores a new QEMU. Target: the larger ratio at most 1.10 (no
   difference beyond the run's noise).
2. ``queued``: ``--queued`` (10,000) deliveries left pending for a webhook whose
   endpoint is dead (nothing listens; every attempt fails and is retried later): the
   reporting daemon's resident memory before and after (``rss_growth_mib``) and the
   deliveries it holds (from ``GET /v1/webhooks/{id}``). The outbox is on disk, so the
   growth must stay small: target at most 64 MiB.

The last line of stdout is one JSON object; bench/README.md says what each figure is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
import leaks
from benchlib import percentile, r1
from forkd.client import Controller
from forkd.launcher import DaemonProcess, free_port

TEMPLATE = "bench-reporting"
WEBHOOKS = 10
TARGET_RATIO = 1.10
TARGET_RSS_GROWTH_MIB = 64


class _Sink(BaseHTTPRequestHandler):
    """Takes any POST (OTLP exports, webhook deliveries) and answers that it did."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


@contextlib.contextmanager
def sink() -> Iterator[int]:
    """A loopback server taking everything, on a free port, for the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ReportingBench(benchlib.DaemonBench):
    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.reporting = DaemonProcess(workdir / "reporting")

    def bench(self) -> None:
        dead_port = free_port()  # nothing listens there
        with sink() as port:
            os.environ.update(OTEL_BSP_SCHEDULE_DELAY="200", OTEL_METRIC_EXPORT_INTERVAL="1000")
            self.daemon.start()
            self.reporting.start(
                "--otlp-endpoint",
                f"http://127.0.0.1:{port}",
                "--webhook-allow",
                f"127.0.0.1:{port}",
                "--webhook-allow",
                f"127.0.0.1:{dead_port}",
            )
            with self.controller() as plain, self._controller(self.reporting) as reporting:
                for ctl in (plain, reporting):
                    self.say.log(f"building {TEMPLATE!r} on {ctl.url}")
                    ctl.create_snapshot(TEMPLATE, image="python", memory_mib=self.args.memory)
                for i in range(WEBHOOKS):
                    reporting.create_webhook(f"http://127.0.0.1:{port}/hook/{i}")
                self._forks(plain, reporting)
                self._queued(reporting, dead_port)

    @staticmethod
    def _controller(daemon: DaemonProcess) -> Controller:
        return Controller(daemon.url, token_file=daemon.token_path, timeout=600)

    def _forks(self, plain: Controller, reporting: Controller) -> None:
        for ctl in (plain, reporting):  # a warm-up each, not counted
            ctl.kill_sandbox(ctl.spawn_sandboxes(TEMPLATE)[0]["id"])
        # pooled: each daemon's warm pool given --settle seconds to refill (and the deliveries
        # of the last fork and kill to go out) before its next fork, so both start from
        # the same state. cold: a memory limit keeps the fork off the pool, so every
        # one restores a new QEMU: the whole fork path, where reporting could weigh.
        for mode, limit in (("fork_ms", None), ("cold_fork_ms", self.args.memory)):
            times: dict[str, list[float]] = {"plain": [], "reporting": []}
            for _ in range(self.args.samples):
                for name, ctl in (("plain", plain), ("reporting", reporting)):
                    time.sleep(self.args.settle)
                    started = time.perf_counter()
                    sid = ctl.spawn_sandboxes(TEMPLATE, memory_limit_mib=limit)[0]["id"]
                    times[name].append((time.perf_counter() - started) * 1000)
                    ctl.kill_sandbox(sid)
            plain_ms, reporting_ms = (percentile(times[n], 50) for n in ("plain", "reporting"))
            self.results[mode] = {
                "plain": r1(plain_ms),
                "reporting": r1(reporting_ms),
                "ratio": round(reporting_ms / plain_ms, 3) if plain_ms else None,
            }
            self.say.log(f"{mode}: {self.results[mode]}")

    def _queued(self, reporting: Controller, dead_port: int) -> None:
        pid = self.reporting.proc.pid if self.reporting.proc else 0
        dead = reporting.create_webhook(f"http://127.0.0.1:{dead_port}/gone")
        before = rss_mib(pid)
        started = time.monotonic()
        for i in range(self.args.queued):
            reporting.test_webhook(dead["id"])
            if i and i % 2000 == 0:
                self.say.log(f"{i} deliveries queued, daemon RSS {rss_mib(pid):.0f} MiB")
        held = reporting.webhook_info(dead["id"])["pending"]
        after = rss_mib(pid)
        self.results["queued"] = {
            "deliveries": self.args.queued,
            "pending": held,
            "queue_secs": r1(time.monotonic() - started),
            "rss_before_mib": r1(before),
            "rss_after_mib": r1(after),
            "rss_growth_mib": r1(after - before),
        }
        self.say.log(f"queued: {self.results['queued']}")

    def _stop_daemon(self) -> None:
        super()._stop_daemon()
        with contextlib.suppress(Exception):
            self.reporting.stop(signal.SIGKILL)
        state = self.reporting.state_dir
        leaks.remove_leftovers(state, leaks.id_prefix(state))


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ratios = [results.get(m, {}).get("ratio") for m in ("fork_ms", "cold_fork_ms")]
    ratio = None if None in ratios else max(r for r in ratios if r is not None)
    growth = results.get("queued", {}).get("rss_growth_mib")
    results["targets"] = {
        "fork_p50_ratio": {
            "value": ratio,
            "target": f"<= {TARGET_RATIO}",
            "met": ratio is not None and ratio <= TARGET_RATIO,
        },
        "queued_rss_growth_mib": {
            "value": growth,
            "target": f"<= {TARGET_RSS_GROWTH_MIB}",
            "met": growth is not None and growth <= TARGET_RSS_GROWTH_MIB,
        },
    }
    results["samples"], results["host_cores"] = args.samples, os.cpu_count()
    return results


def render(out: Console, bench: ReportingBench, res: dict[str, Any]) -> None:
    title = (
        f"webhooks + OpenTelemetry beside neither ({res.get('accel')}, {res['host_cores']} cores)"
    )
    out.print(benchlib.targets_table(title, res["targets"]))
    for name in ("fork_ms", "cold_fork_ms", "queued"):
        if name in res:
            out.print(f"{name}: {res[name]}", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=30, help="timed forks on each daemon (30)")
    p.add_argument("--queued", type=int, default=10_000, help="deliveries left pending (10000)")
    p.add_argument("--memory", type=int, default=256, help="template memory in MiB (256)")
    p.add_argument(
        "--settle", type=float, default=1.0, help="seconds between a kill and the next fork (1)"
    )
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.samples < 1 or args.queued < 1:
        p.error("--samples and --queued must be at least 1")
    return benchlib.run_main(
        benchlib.amain(args, ReportingBench, finish_results, render, workdir_prefix="forkd-rep-")
    )


if __name__ == "__main__":
    sys.exit(main())
