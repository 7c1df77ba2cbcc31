"""Distribution benchmark: snapshots through an OCI registry, and the gateway's cost.

Run from the repository root::

    python bench/distribute.py                 # table on stdout, then one JSON line
    python bench/distribute.py --json-only     # only the JSON line

It starts Debian's ``docker-registry`` on loopback, two ``forkd serve`` (a and
b, fresh state dirs) and a ``forkd gateway`` over both, builds a template of
the ``python`` image on a, and measures:

1. ``push_mib_s``: a's first push of the template (image files included) to
   the registry, bytes sent per second; ``push_again_s`` a second push (every
   blob there: only the manifest goes);
2. ``pull_mib_s`` and ``remote_fork_s``: b pulls it (bytes fetched per second,
   from b's ``forkd_registry_bytes``), then forks a child: pull plus fork, next
   to ``local_fork_ms_p50`` (a child forked on a, where the snapshot is);
3. ``branch_upload_over_written``: a child on a writes ``--written-mib`` MiB
   of random bytes, is branched, and the branch is pushed: bytes uploaded over
   the pages its QEMU wrote since the fork (``pages_written`` times 4 KiB; target
   ≤ 1.05), beside ``branch_full_bytes`` (what a flattened push holds, the image's
   ``image_bytes`` included: ``branch_full_memory_bytes`` without them);
   ``branch_remote_fork_s``: the gateway forks that branch on b (push, pull of
   the delta over b's template, fork);
4. ``gateway_overhead_ms_p50``: ``GET /v1/sandboxes/{id}`` straight to a and
   through the gateway, ``--requests`` times each, interleaved: the p50 of the
   difference (target ≤ 5 ms).

Every process and VM is stopped at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from forkd.client import Controller
from forkd.launcher import DaemonProcess, GatewayProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' registry helper
from tests.registry_server import RegistryServer

import benchlib
import leaks
from benchlib import MIB, judge, percentile, r1

TEMPLATE = "dist-bench"
GATEWAY_TOKEN = "distribute-bench-token"
TARGETS = {
    "branch_upload_over_written": ("branch_upload_over_written", "<=", 1.05),
    "gateway_overhead_ms_p50": ("gateway_overhead_ms_p50", "<=", 5.0),
}


def _registry_bytes(url: str, token: str, direction: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    for line in text.splitlines():
        if line.startswith(f'forkd_registry_bytes_total{{direction="{direction}"}}'):
            return float(line.split()[-1])
    return 0.0


class DistributeBench(benchlib.BenchBase):
    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.a = DaemonProcess(workdir / "a")
        self.b = DaemonProcess(workdir / "b")
        self.registry: RegistryServer | None = None
        self.gateway: GatewayProcess | None = None

    def ctl(self, d: DaemonProcess) -> Controller:
        return Controller(d.url, token_file=d.token_path, timeout=1800)

    def start(self) -> None:
        self.registry = RegistryServer()
        # A registry on loopback is reached only when the daemon lists it.
        listed = ("--insecure-registry", self.registry.address)
        for d in (self.a, self.b):
            d.start("--kill-on-exit", *listed)
        token = self.workdir / "gateway-token"
        token.write_text(GATEWAY_TOKEN + "\n")
        (self.workdir / "gw").mkdir()
        self.gateway = GatewayProcess(self.workdir / "gw", [self.a.url, self.b.url],
                                      self.a.token_path, token)  # fmt: skip
        # Both daemons must take the same node token: b is given a's.
        self.b.stop()
        self.b.token_file = self.a.token_path
        self.b.start("--kill-on-exit", *listed)
        # The repository the template went through: the branch then moves as a delta.
        self.gateway.start("--registry", f"{self.registry.address}/forkd/bench")

    def transfer(self, a: Controller, b: Controller) -> None:
        assert self.registry is not None
        ref = self.registry.ref("forkd/bench", TEMPLATE)
        pushed = a.push_snapshot(TEMPLATE, ref)
        again = a.push_snapshot(TEMPLATE, ref)
        before = _registry_bytes(self.b.url, self.a.token or "", "pull")
        t0 = time.monotonic()
        b.pull_snapshot(ref, TEMPLATE)
        pulled_s = time.monotonic() - t0
        fetched = _registry_bytes(self.b.url, self.a.token or "", "pull") - before
        kid = b.spawn_sandboxes(TEMPLATE)[0]
        remote = time.monotonic() - t0
        b.kill_sandbox(kid["id"])
        local = []
        for _ in range(self.args.forks):
            t = time.monotonic()
            k = a.spawn_sandboxes(TEMPLATE)[0]
            local.append((time.monotonic() - t) * 1000)
            a.kill_sandbox(k["id"])
        self.results.update(
            push_bytes=pushed["bytes_uploaded"],
            push_s=pushed["seconds"],
            push_mib_s=r1(pushed["bytes_uploaded"] / MIB / max(pushed["seconds"], 1e-3)),
            push_again_s=again["seconds"],
            push_again_bytes=again["bytes_uploaded"],
            pull_bytes=int(fetched),
            pull_s=r1(pulled_s),
            pull_mib_s=r1(fetched / MIB / max(pulled_s, 1e-3)),
            remote_fork_s=r1(remote),
            local_fork_ms_p50=r1(percentile(local, 50)),
        )

    def branch(self, a: Controller, gw: Controller) -> str:
        assert self.registry is not None
        kid = a.spawn_sandboxes(TEMPLATE)[0]
        code = f"import os\nblob = os.urandom({self.args.written_mib} << 20)\nlen(blob)"
        a.eval_code(kid["id"], code)
        info = a.branch_sandbox(kid["id"], "dist-branch")
        written = json.loads((Path(info["dir"]) / "snapshot.json").read_text())["pages_written"]
        pushed = a.push_snapshot("dist-branch", self.registry.ref("forkd/bench", "branch"))
        flat = a.push_snapshot("dist-branch", self.registry.ref("forkd/flat", "branch"),
                               flatten=True)  # fmt: skip
        t0 = time.monotonic()
        b_id = self.node_id(self.b)
        remote = gw.spawn_sandboxes("dist-branch", node=b_id)[0]
        machine = json.loads((Path(info["dir"]) / "snapshot.json").read_text())["machine"]
        image = sum(Path(machine[k]).stat().st_size for k in ("vmlinuz", "initrd", "rootfs"))
        self.results.update(
            image_bytes=image,
            branch_full_memory_bytes=flat["bytes_total"] - image,
            branch_written_mib=self.args.written_mib,
            branch_pages_written=written,
            branch_bytes_uploaded=pushed["bytes_uploaded"],
            branch_encoding=pushed["encoding"],
            branch_full_bytes=flat["bytes_total"],
            branch_upload_over_written=round(pushed["bytes_uploaded"] / (written * 4096), 3),
            branch_remote_fork_s=r1(time.monotonic() - t0),
        )
        gw.kill_sandbox(remote["id"])
        return str(kid["id"])

    def node_id(self, d: DaemonProcess) -> str:
        headers = {"Authorization": f"Bearer {d.token}"}
        return str(httpx.get(f"{d.url}/v1/capacity", headers=headers).json()["node_id"])

    def overhead(self, sandbox_id: str) -> None:
        assert self.gateway is not None
        direct_h = {"Authorization": f"Bearer {self.a.token}"}
        gw_h = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
        direct: list[float] = []
        via: list[float] = []
        path = f"/v1/sandboxes/{sandbox_id}"
        with httpx.Client() as c:
            for _ in range(self.args.requests):
                for url, headers, into in ((self.a.url, direct_h, direct),
                                           (self.gateway.url, gw_h, via)):  # fmt: skip
                    t = time.perf_counter()
                    c.get(url + path, headers=headers).raise_for_status()
                    into.append((time.perf_counter() - t) * 1000)
        diffs = [v - d for v, d in zip(via, direct, strict=True)]
        self.results.update(
            direct_ms_p50=round(statistics.median(direct), 2),
            gateway_ms_p50=round(statistics.median(via), 2),
            gateway_overhead_ms_p50=round(statistics.median(diffs), 2),
            gateway_requests=self.args.requests,
        )

    def bench(self) -> None:
        self.start()
        assert self.gateway is not None
        with self.ctl(self.a) as a, self.ctl(self.b) as b, \
                Controller(self.gateway.url, token=GATEWAY_TOKEN, timeout=1800) as gw:  # fmt: skip
            self.say.log("building the template on a")
            a.create_snapshot(TEMPLATE, image="python", memory_mib=self.args.memory)
            self.say.log("push, pull on b, forks")
            self.transfer(a, b)
            self.say.log("a branch, pushed and forked on b through the gateway")
            kid = self.branch(a, gw)
            self.say.log(f"gateway overhead: {self.args.requests} requests each way")
            self.overhead(kid)

    async def run(self) -> None:
        import asyncio

        from forkd import accel

        self.results["accel"] = accel.choose().name
        await asyncio.to_thread(self.bench)

    async def kill_all(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for d in (self.a, self.b):
            with contextlib.suppress(Exception):  # whatever it left is removed next
                d.stop(signal.SIGKILL)
            leaks.remove_leftovers(d.state_dir, leaks.id_prefix(d.state_dir))
        if self.registry is not None:
            self.registry.stop()


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["targets"] = judge(results, TARGETS)
    results["met"] = all(t["met"] for t in results["targets"].values())
    results["memory_mib"] = args.memory
    results["host_cores"] = os.cpu_count()
    return results


def render(out: Console, bench: DistributeBench, res: dict[str, Any]) -> None:
    title = f"forkd distribution ({res.get('accel')}, {res['host_cores']} cores)"
    t = benchlib.targets_table(title, res["targets"])
    for key in ("push_bytes", "push_s", "push_mib_s", "push_again_s", "pull_bytes", "pull_s",
                "pull_mib_s", "remote_fork_s", "local_fork_ms_p50", "branch_pages_written",
                "branch_bytes_uploaded", "branch_encoding", "branch_full_bytes",
                "image_bytes", "branch_full_memory_bytes", "push_again_bytes",
                "branch_remote_fork_s", "direct_ms_p50", "gateway_ms_p50"):  # fmt: skip
        t.add_row(key, str(res.get(key)), "", "")
    out.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory", type=int, default=256, help="template RAM in MiB (256)")
    p.add_argument("--written-mib", type=int, default=32, help="the branch writes (32)")
    p.add_argument("--forks", type=int, default=5, help="local forks timed (5)")
    p.add_argument("--requests", type=int, default=200, help="per path, overhead (200)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if not 1 <= args.written_mib <= args.memory - 112:
        p.error("--written-mib must be 1..memory-112")
    return benchlib.run_main(benchlib.amain(args, DistributeBench, finish_results, render,
                                            workdir_prefix="forkd-distribute-"))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
