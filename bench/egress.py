"""Egress proxy benchmark: what the proxy costs a guest's HTTPS, side by side in one run.

Run from the repository root (root, network namespaces)::

    python bench/egress.py                 # table on stdout, then one JSON line
    python bench/egress.py --json-only

The "internet" is tests/egress_world.py's: HTTPS, HTTP and a raw banner in a
network namespace this benchmark makes (no packet leaves the machine). The
guests of phases 1-3 are namespaces standing where a VM's tap would be (real
nftables rules, the real proxy, Python's own HTTPS client), so the figures are
the proxy's, not TCG's:

1. ``https_ms``: p50/p99 of ``--requests`` HTTPS GETs, each on a new connection
   (TCP + TLS + request) and all on one kept-alive connection, three ways:
   ``direct`` (a namespace without the proxy: the kernel forwards by address),
   ``passthrough`` (through the proxy, decided by SNI, never decrypted) and
   ``intercepted`` (terminated with the daemon's CA, a secret put into the
   request's header, re-encrypted upstream);
2. ``download_mib_s`` and ``upload_mib_s``: ``--transfer-mib`` MiB each way on
   each path;
3. ``kib_per_idle_connection``: what 1,000 idle proxied connections cost the
   daemon's process (its RSS before and after, over 1,000);
4. ``fork_ms``: p50 of ``--forks`` real forks (QEMU, TCG here) of one template:
   with the kernel alone, through the proxy with no policy, and through the proxy
   with an allow list and a rule.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.egress_world
from tests import egress_world

import benchlib
from benchlib import percentile, r1
from forkd.egress.ca import EgressCA
from forkd.egress.intercept import Interceptor
from forkd.egress.proxy import EgressProxy
from forkd.egress.resolver import PinnedHosts, Resolver
from forkd.vmm.jail import network
from forkd.vmm.jail.egress import Egress
from forkd.vmm.snapshot.files import SnapshotLabels
from forkd.vmm.vm import VM

SECRET_VALUE = "sk-bench-0123456789abcdef"

# In a guest: N HTTPS GETs on new connections; their latencies in ms, as JSON.
GETS = """
import http.client, json, socket, ssl, sys, time
name, n, header, cafile, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
ctx = ssl.create_default_context(cafile=cafile)
class To(http.client.HTTPSConnection):  # the guest's DNS has no say: the web's address
    def connect(self):
        raw = socket.create_connection(("198.19.0.20", 443), timeout=30)
        self.sock = ctx.wrap_socket(raw, server_hostname=name)
times = []
kept = To(name, 443, timeout=30)
for _ in range(n):
    started = time.perf_counter()
    c = kept if mode == "keepalive" else To(name, 443, timeout=30)
    c.request("GET", "/echo", headers={"Authorization": header})
    c.getresponse().read()
    if mode != "keepalive":
        c.close()
    times.append((time.perf_counter() - started) * 1000)
print(json.dumps(times))
"""

# In a guest: MiB down, then MiB up; seconds each, as JSON.
TRANSFER = """
import http.client, json, socket, ssl, sys, time
name, mib, cafile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ctx = ssl.create_default_context(cafile=cafile)
class To(http.client.HTTPSConnection):
    def connect(self):
        raw = socket.create_connection(("198.19.0.20", 443), timeout=120)
        self.sock = ctx.wrap_socket(raw, server_hostname=name)
c = To(name, 443, timeout=120)
started = time.perf_counter(); c.request("GET", f"/bytes/{mib << 20}"); r = c.getresponse()
while r.read(1 << 20): pass
down = time.perf_counter() - started
body = b"x" * (mib << 20)
started = time.perf_counter(); c.request("POST", "/echo", body=body); c.getresponse().read()
up = time.perf_counter() - started
print(json.dumps([down, up]))
"""

# In a guest: N idle connections to the raw banner port, held until stdin closes.
HOLD = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[1])):
    try:
        held.append(socket.create_connection(("198.19.0.20", 2222), timeout=5))
    except OSError:
        pass
    time.sleep(0.004)  # under the namespace's 500 new connections a second
alive = 0
for s in held:
    s.settimeout(3)
    try:
        alive += bool(s.recv(100))
    except OSError:
        pass
print(alive, flush=True)
sys.stdin.read()
"""


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Secrets:
    def value_for(self, name: str, host: str) -> str | None:
        return SECRET_VALUE if name == "bench" and host == "api.test.example" else None

    def any_for(self, host: str) -> bool:
        return host == "api.test.example"


class EgressBench(benchlib.BenchBase):
    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.stack = contextlib.ExitStack()
        self.nets: list[tuple[network.SandboxNet, str | None]] = []

    async def kill_all(self) -> None:
        await super().kill_all()
        for net, guest in self.nets:
            await network.detach(net)
            if guest:
                subprocess.run(["ip", "netns", "del", guest], check=False, capture_output=True)
        if hasattr(self, "proxy"):
            await self.proxy.close()
        await asyncio.to_thread(self.stack.close)  # pyroute2's sync API: off the loop

    async def _guest(self, host: network.HostNetwork, policy: Egress, label: str) -> str:
        vm_id = f"bench-egress-{os.getpid()}-{label}"
        net = await network.attach(host, vm_id, policy)
        assert net is not None
        guest = f"fkb-{os.getpid()}-{label}"
        self.nets.append((net, guest))
        await asyncio.to_thread(egress_world.swap_in_guest, net.netns, guest)
        return guest

    async def _in(self, guest: str, code: str, *args: str, stdin: str | None = None) -> Any:
        proc = await asyncio.create_subprocess_exec(
            "nsenter", f"--net=/run/netns/{guest}", "--", sys.executable, "-c", code, *args,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"guest program failed: {err.decode()[-400:]}")
        return json.loads(out)

    async def run(self) -> None:
        from forkd.controller.server import raise_open_file_limit

        raise_open_file_limit()  # as forkd serve does: 1,000 connections hold 2,000 fds
        if problems := network.netns_problems():
            raise RuntimeError("no network namespaces: " + "; ".join(problems))
        world = await asyncio.to_thread(
            self.stack.enter_context, egress_world.outside(self.workdir / "world")
        )
        self.direct_host = network.HostNetwork(mode="netns")
        self.host = network.HostNetwork(mode="netns")
        ca = EgressCA(self.workdir / "state")
        interception = Interceptor(ca, Secrets(), world.ca.cert)
        resolver = Resolver(PinnedHosts(world.hosts_file))
        self.proxy = EgressProxy(resolver, str(self.host.cidr), interception=interception)
        self.host.use_egress(self.proxy)
        trust = self.workdir / "trust.pem"
        trust.write_bytes(ca.pem + world.ca.cert.read_bytes())
        paths = {
            "direct": (await self._guest(self.direct_host, Egress("internet"), "d"),
                       "other.test.example"),
            "passthrough": (await self._guest(self.host, Egress("internet"), "p"),
                            "other.test.example"),
            "intercepted": (await self._guest(self.host, Egress("internet"), "i"),
                            "api.test.example"),
        }  # fmt: skip
        await self._latency(paths, trust)
        await self._throughput(paths, trust)
        await self._idle_memory(paths["passthrough"][0])
        await self._forks(ca)

    async def _latency(self, paths: dict[str, tuple[str, str]], trust: Path) -> None:
        n = str(self.args.requests)
        res = self.results
        for mode in ("new_connection", "keepalive"):
            for label, (guest, name) in paths.items():
                self.say.log(f"{n} HTTPS requests, {label}, {mode}")
                times = await self._in(guest, GETS, name, n, "Bearer ${secrets.bench}",
                                       str(trust), mode)  # fmt: skip
                p50, p99 = percentile(times, 50), percentile(times, 99)
                res[f"https_ms_{mode}_{label}_p50"] = r1(p50)
                res[f"https_ms_{mode}_{label}_p99"] = r1(p99)
                self.rows.append((f"HTTPS request ({mode}), {label}", f"p50 {p50:.2f} ms",
                                  f"p99 {p99:.2f} ms"))  # fmt: skip
            res[f"intercept_adds_ms_{mode}_p50"] = r1(
                res[f"https_ms_{mode}_intercepted_p50"] - res[f"https_ms_{mode}_passthrough_p50"]
            )

    async def _throughput(self, paths: dict[str, tuple[str, str]], trust: Path) -> None:
        mib = self.args.transfer_mib
        for label, (guest, name) in paths.items():
            self.say.log(f"{mib} MiB each way, {label}")
            down, up = await self._in(guest, TRANSFER, name, str(mib), str(trust))
            self.results[f"download_mib_s_{label}"] = r1(mib / down)
            self.results[f"upload_mib_s_{label}"] = r1(mib / up)
            self.rows.append((f"{mib} MiB, {label}", f"down {mib / down:.0f} MiB/s",
                              f"up {mib / up:.0f} MiB/s"))  # fmt: skip

    async def _idle_memory(self, guest: str) -> None:
        from forkd.egress import proxy as egress_proxy

        n = 1000
        egress_proxy.MAX_CONNECTIONS = n + 100  # the per-sandbox cap, for this measure
        before = _rss_kib()
        proc = await asyncio.create_subprocess_exec(
            "nsenter", f"--net=/run/netns/{guest}", "--", sys.executable, "-c", HOLD, str(n),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        held = int((await proc.stdout.readline()).decode().strip() or 0)
        await asyncio.sleep(1)
        after = _rss_kib()
        proc.stdin.close()
        await proc.wait()
        self.results["idle_connections"] = held
        self.results["kib_per_idle_connection"] = r1((after - before) / max(held, 1))
        self.rows.append((f"{held} idle proxied connections",
                          f"{(after - before) / max(held, 1):.1f} KiB each", ""))  # fmt: skip

    async def _forks(self, ca: EgressCA) -> None:
        image = await self.python_image()
        # A template with a network of its own (a tap), as a daemon's are: its forks get one.
        tpl = await VM.boot(image, run_root=self.run_root, memory_mib=256, vcpus=1,
                            host_network=self.direct_host)  # fmt: skip
        self.vms.append(tpl)
        snap = self._new_snap_dir("egress")
        await tpl.snapshot(snap, SnapshotLabels(tag="egress"))
        await self._kill([tpl])
        policy = Egress.parse(
            {
                "allow_out": ["api.test.example", "*.pypi.org"],
                "rules": {
                    "api.test.example": [{"transform": {"headers": {"X-Key": "${secrets.bench}"}}}]
                },
            }
        )
        ways = {"kernel": (self.direct_host, None), "proxy": (self.host, None),
                "proxy_policy": (self.host, policy)}  # fmt: skip
        for label, (host, given) in ways.items():
            times = []
            for _ in range(self.args.forks):
                vm = await VM.restore(snap, run_root=self.run_root, host_network=host,
                                      egress_policy=given)  # fmt: skip
                self.vms.append(vm)
                times.append(vm.ready_ms or 0.0)
                await self._kill([vm])
            self.results[f"fork_ms_{label}_p50"] = r1(percentile(times, 50))
            self.rows.append((f"fork, {label}", f"p50 {percentile(times, 50):.1f} ms", ""))


def finish(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["requests"] = args.requests
    results["transfer_mib"] = args.transfer_mib
    return results


def render(out: Console, bench: EgressBench, results: dict[str, Any]) -> None:
    table = Table(title="egress proxy")
    for col in ("what", "figure", ""):
        table.add_column(col)
    for row in bench.rows:
        table.add_row(*row)
    out.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200, help="HTTPS requests per path (200)")
    p.add_argument("--transfer-mib", type=int, default=100, help="MiB each way (100)")
    p.add_argument("--forks", type=int, default=8, help="forks per way, for p50 (8)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    return benchlib.run_main(
        benchlib.amain(args, EgressBench, finish, render, workdir_prefix="forkd-bench-egress-")
    )


if __name__ == "__main__":
    sys.exit(main())
