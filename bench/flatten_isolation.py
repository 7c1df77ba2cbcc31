"""What flattening a hostile image costs the daemon: in its own process (on an import
thread, as forkd did) against in a worker process (as it does now), side by side.

A layer of many empty files (``--entries``, long names, 10,000 to a directory) is the
cheapest way to make the merge work hard. While it is flattened on a thread, an asyncio loop in this
process (standing in for the daemon's) sleeps 5 ms at a time and records how late
each wake-up is: the lag its requests would see. Also the flatten's wall time, the
CPU this process spent, and how far its RSS grew while it ran. Prints a table, then one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import statistics
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd.image_import import flatten_worker, squash
from forkd.image_import.model import LayerBlob

TICK_SECS = 0.005
PER_DIRECTORY = 10_000


def _layer(directory: Path, entries: int) -> LayerBlob:
    path = directory / "layer.tar.gz"
    with tarfile.open(path, mode="w:gz", compresslevel=1) as tar:  # streamed: no peak here
        for i in range(entries):
            if i % PER_DIRECTORY == 0:  # under layers.MAX_DIR_ENTRIES, quick for tar2sqfs
                top = tarfile.TarInfo(f"d{i // PER_DIRECTORY}")
                top.type = tarfile.DIRTYPE
                tar.addfile(top)
            tar.addfile(tarfile.TarInfo(f"d{i // PER_DIRECTORY}/{'n' * 150}{i:07d}"))
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return LayerBlob(digest=digest, size=path.stat().st_size, media_type="gzip", path=path)


def _measure(flatten: Callable[..., Any], layer: LayerBlob, work: Path) -> dict[str, float]:
    out_dir = work / "out"
    scratch = work / "scratch"
    for d in (out_dir, scratch):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    lags: list[float] = []
    done = threading.Event()
    wall: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            flatten([layer], out_dir / "rootfs.sqfs", scratch)
        finally:
            wall.append(time.monotonic() - t0)
            done.set()

    rss = [_rss_mib()]

    async def loop() -> None:
        thread = threading.Thread(target=run)
        thread.start()
        while not done.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(TICK_SECS)
            lags.append((time.monotonic() - t0 - TICK_SECS) * 1000)
            if len(lags) % 10 == 0:
                rss.append(_rss_mib())
        thread.join()

    cpu_before = time.process_time()
    asyncio.run(loop())
    lags.sort()
    return {
        "wall_s": round(wall[0], 2),
        "loop_lag_ms_p50": round(statistics.median(lags), 2),
        "loop_lag_ms_p99": round(lags[int(len(lags) * 0.99)], 2),
        "loop_lag_ms_max": round(lags[-1], 2),
        "cpu_s_this_process": round(time.process_time() - cpu_before, 2),
        "rss_growth_mib_max": round(max(rss) - rss[0], 1),
    }


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forkd-flatten-"))
    try:
        layer = _layer(work, args.entries)
        # The worker first: the in-process run raises this process's peak RSS for good.
        results = {
            "worker": _measure(flatten_worker.build_rootfs, layer, work),
            "in_process": _measure(squash.build_rootfs, layer, work),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.json_only:
        keys = list(results["worker"])
        print(f"{'':24}{'in the daemon':>16}{'in a worker':>14}")
        for key in keys:
            print(f"{key:24}{results['in_process'][key]:>16}{results['worker'][key]:>14}")
    print(json.dumps({"entries": args.entries, **results}))


if __name__ == "__main__":
    main()
