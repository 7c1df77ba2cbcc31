"""Streaming benchmark: output latency and throughput, file transfer, a non-reader's cost.

Run from the repository root::

    python bench/stream.py                 # table on stdout, then one JSON line
    python bench/stream.py --json-only     # only the JSON line

It starts its own ``forkd serve`` (a temporary state dir), builds a template of
the ``python`` image and forks one sandbox, then measures through the SDK:

1. ``echo_rtt_ms``: a byte sent to ``cat``'s stdin (``send_stdin``) until the
   reader of the output stream sees it come back, ``--samples`` times. Guest
   and host clocks differ, so a round trip is what can be timed honestly: it
   is an upper bound of the first-byte latency (it also holds the stdin POST).
   ``first_output_ms``: ``commands.run("echo", on_stdout=...)`` until the
   first callback, start of the process included.
2. ``stdout_mib_s``: a process writing ``--stream-mib`` MiB (text, NUL bytes
   and random bytes), read as SSE by the SDK (``Controller.process_output``,
   counting bytes, so the client holds none of them).
3. ``file_upload_mib_s`` / ``file_download_mib_s``: ``sb.files.write`` and
   ``sb.files.read`` of ``--file-mib`` MiB; skipped, with the reason, when the
   daemon refuses a file that large.
4. ``daemon_rss_mib``: the daemon's VmRSS sampled every second for
   ``--rss-secs`` while a raw socket that never reads holds a followed output
   stream of a process writing ``--rss-gib`` GiB; start, max and end.

bench/README.md says what each figure is. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import queue
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from forkd.client import ControllerError, Sandbox
from forkd.client.commands import CommandHandle
from forkd.vmm.qemu.host_processes import qemu_pids_under

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
import benchlib
from benchlib import MIB, cpu_secs, judge, percentile, r1

TEMPLATE = "stream-bench"
TEXT_LINE = "the quick brown fox jumps over the lazy dog 0123456789"
WRITERS = {  # stdout variant: the shell command writing N MiB to stdout
    "text": f"yes '{TEXT_LINE}' | head -c {{n}}M",
    "zeros": "head -c {n}M /dev/zero",
    "random": "head -c {n}M /dev/urandom",
}
ECHO_WAIT_SECS = 10.0
TARGETS = {  # name: (metric key, comparison, bound)
    "echo_rtt_p50_ms": ("echo_rtt_ms.p50", "<=", 50.0),
    "stdout_text_mib_s": ("stdout_mib_s.text", ">=", 20.0),
    "file_upload_mib_s": ("file_upload_mib_s", ">=", 50.0),
    "file_download_mib_s": ("file_download_mib_s", ">=", 50.0),
}
RSS_FLAT_MIB = 32.0  # max - start beyond this is growth, not noise


def stats_ms(samples: list[float]) -> dict[str, Any]:
    return {"p50": r1(percentile(samples, 50)), "p90": r1(percentile(samples, 90)),
            "max": r1(max(samples)), "n": len(samples)}  # fmt: skip


def _stamp(seen: list[float], _text: str) -> None:
    """An output callback: when the output came."""
    seen.append(time.monotonic())


def daemon_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class OutputReader:
    """A thread iterating over a CommandHandle, putting (time seen, text) on a queue."""

    def __init__(self, handle: CommandHandle) -> None:
        self.handle = handle
        self.seen: queue.Queue[tuple[float, str]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="stream-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(ControllerError):
            for stdout, _stderr, _pty in self.handle:
                if stdout:
                    self.seen.put((time.monotonic(), stdout))

    def wait_for(self, text: str) -> float:
        """When ``text`` was seen (it may come in pieces)."""
        got = ""
        while text not in got:
            at, piece = self.seen.get(timeout=ECHO_WAIT_SECS)
            got += piece
        return at


class StreamBench(benchlib.DaemonBench):
    """The run: the daemon, the template, one sandbox, the four measurements."""

    # ------------------------------------------------------------ latency

    def echo_round_trips(self, sb: Sandbox) -> None:
        handle = sb.commands.run("cat", background=True, stdin=True)
        reader = OutputReader(handle)
        try:
            handle.send_stdin("warm\n")
            reader.wait_for("warm")
            rtts = []
            for i in range(self.args.samples):
                token = f"s{i}\n"
                t0 = time.monotonic()
                handle.send_stdin(token)
                rtts.append((reader.wait_for(token) - t0) * 1000)
            self.results["echo_rtt_ms"] = stats_ms(rtts)
        finally:
            handle.kill()

    def first_output(self, sb: Sandbox) -> None:
        firsts: list[float] = []
        for _ in range(max(5, self.args.samples // 3)):
            t0 = time.monotonic()
            seen: list[float] = []
            sb.commands.run("echo hi", on_stdout=functools.partial(_stamp, seen))
            firsts.append((seen[0] - t0) * 1000)
        self.results["first_output_ms"] = stats_ms(firsts)

    # ------------------------------------------------------------ throughput

    def stdout_throughput(self, sb: Sandbox, variant: str) -> None:
        """Bytes delivered per second. The agent drains a process into its 4 MiB ring
        whatever the reader does, so a writer faster than the stream loses output
        (a ``gap`` event): the rate counts delivered bytes only, and the writer's own
        speed into /dev/null is measured beside it."""
        ctl = sb.controller
        cmd = WRITERS[variant].format(n=self.args.stream_mib)
        cpu_before = self.cpu_now()
        t0 = time.monotonic()
        pid = int(ctl.start_process(sb.id, cmd)["pid"])
        received = lost = events = 0
        exit_code = None
        for event in ctl.process_output(sb.id, pid):
            events += 1
            received += len(event.data)
            if event.kind == "gap":
                lost += (event.next_offset or 0) - (event.offset or 0)
            elif event.kind == "exit":
                exit_code = event.exit_code
        secs = time.monotonic() - t0
        cpu = {k: r1((v - cpu_before[k]) * 1000 / max(received / MIB, 1))
               for k, v in self.cpu_now().items()}  # fmt: skip
        self.results.setdefault("cpu_ms_per_mib", {})[variant] = cpu
        if exit_code != 0 or received + lost != self.args.stream_mib * MIB:
            raise RuntimeError(f"{variant}: exit {exit_code}, {received} read, {lost} lost")
        self.results.setdefault("stdout_mib_s", {})[variant] = r1(received / MIB / secs)
        self.results.setdefault("stdout_lost_mib", {})[variant] = r1(lost / MIB)
        self.results.setdefault("stdout_events", {})[variant] = events
        self.results.setdefault("guest_writer_mib_s", {})[variant] = self.writer_speed(sb, cmd)

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far of the daemon, its QEMUs (the guest's vCPU and I/O) and us."""
        assert self.daemon.proc is not None
        qemus = qemu_pids_under(self.daemon.state_dir)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"daemon": cpu_secs(self.daemon.proc.pid),
                "qemu": sum(cpu_secs(pid) for pid in qemus),
                "client": usage.ru_utime + usage.ru_stime}  # fmt: skip

    def writer_speed(self, sb: Sandbox, cmd: str) -> float | None:
        """The guest's own speed of ``cmd`` into /dev/null, timed in the guest."""
        timed = f"a=$(date +%s.%N); {cmd} >/dev/null; b=$(date +%s.%N); echo $a $b"
        r = sb.commands.run(timed, timeout=300)
        started, ended = (float(x) for x in r.stdout.split())
        return r1(self.args.stream_mib / max(ended - started, 1e-6))

    def file_transfer(self, sb: Sandbox) -> None:
        """Up and down through ``sb.files`` in 1 MiB chunks, checked by their digest."""
        block = os.urandom(MIB)
        sent = hashlib.sha256()
        path = "/root/stream-bench.bin"

        def chunks() -> Iterator[bytes]:
            for i in range(self.args.file_mib):
                piece = i.to_bytes(8, "little") + block[8:]  # no two chunks alike
                sent.update(piece)
                yield piece

        t0 = time.monotonic()
        try:
            sb.files.write(path, chunks())
        except (ControllerError, TypeError) as exc:  # TypeError: an SDK without streamed writes
            self.results["file_transfer_skipped"] = (
                f"a {self.args.file_mib} MiB upload failed ({str(exc)[:200]}): "
                "no large-file path in this daemon or SDK"
            )
            return
        self.results["file_upload_mib_s"] = r1(self.args.file_mib / (time.monotonic() - t0))
        t0 = time.monotonic()
        got, size = hashlib.sha256(), 0
        for chunk in sb.files.read(path, format="stream"):
            got.update(chunk)
            size += len(chunk)
        self.results["file_download_mib_s"] = r1(size / MIB / (time.monotonic() - t0))
        if got.digest() != sent.digest():
            raise RuntimeError(f"the download differs from the upload ({size} bytes back)")
        sb.files.remove(path)

    # ------------------------------------------------------------ a non-reader

    def non_reader_rss(self, sb: Sandbox) -> None:
        assert self.daemon.proc is not None
        cmd = f"head -c {self.args.rss_gib * 1024}M /dev/zero"
        pid = int(sb.controller.start_process(sb.id, cmd)["pid"])
        samples: list[float] = []
        with self.stalled_stream(sb.id, pid):
            for _ in range(self.args.rss_secs):
                samples.append(daemon_rss_mib(self.daemon.proc.pid))
                time.sleep(1.0)
            end_info = sb.controller.get_process(sb.id, pid)
        sb.commands.kill(pid)
        rss: dict[str, Any] = {
            "start": r1(samples[0]),
            "max": r1(max(samples)),
            "end": r1(samples[-1]),
            "samples": [r1(v) for v in samples],
        }
        rss["flat"] = max(samples) - samples[0] <= RSS_FLAT_MIB
        rss["guest_output_mib"] = r1(end_info["output_end"] / MIB)
        self.results["daemon_rss_mib"] = rss

    @contextlib.contextmanager
    def stalled_stream(self, sandbox_id: str, pid: int) -> Any:
        """A followed output stream on a socket that never reads."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert self.daemon.port is not None
        sock.connect(("127.0.0.1", self.daemon.port))
        token = self.daemon.token
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        sock.sendall(
            f"GET /v1/sandboxes/{sandbox_id}/processes/{pid}/output?follow=true HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nAccept: text/event-stream\r\n{auth}\r\n".encode()
        )
        try:
            yield sock
        finally:
            sock.close()

    # ------------------------------------------------------------ the run

    def phase(self, name: str, step: Callable[[], None]) -> None:
        self.say.log(f"{name}...")
        t0 = time.monotonic()
        try:
            step()
        except Exception as exc:
            self.fail(name, exc)
        self.results.setdefault("phase_secs", {})[name] = r1(time.monotonic() - t0)

    def bench(self) -> None:
        self.daemon.start()
        self.say.log(f"daemon {self.daemon.url}, building template {TEMPLATE!r}")
        with self.controller() as ctl:
            ctl.create_snapshot(TEMPLATE, image="python", memory_mib=self.args.memory)
            with Sandbox(TEMPLATE, controller=ctl) as sb:
                self.phase("echo round trip", lambda: self.echo_round_trips(sb))
                self.phase("first output", lambda: self.first_output(sb))
                for variant in self.args.variants:
                    self.phase(
                        f"stdout {variant}", functools.partial(self.stdout_throughput, sb, variant)
                    )
                if self.args.file_mib:
                    self.phase("files", lambda: self.file_transfer(sb))
                if self.args.rss_secs:
                    self.phase("non-reader RSS", lambda: self.non_reader_rss(sb))


# ------------------------------------------------------------------ report


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    targets = judge(results, TARGETS)
    rss = results.get("daemon_rss_mib")
    targets["daemon_rss_flat"] = {"value": rss and rss["max"] - rss["start"],
                                  "target": f"<= {RSS_FLAT_MIB:g} MiB growth",
                                  "met": rss and rss["flat"]}  # fmt: skip
    results["targets"] = targets
    results["stream_mib"], results["file_mib"] = args.stream_mib, args.file_mib
    results["host_cores"] = os.cpu_count()
    return results


def render(out: Console, bench: StreamBench, res: dict[str, Any]) -> None:
    title = f"forkd streaming ({res.get('accel')}, {res['host_cores']} cores)"
    t = benchlib.targets_table(title, res["targets"])
    out.print(t)
    for key in ("echo_rtt_ms", "first_output_ms", "stdout_mib_s", "stdout_lost_mib",
                "stdout_events", "guest_writer_mib_s", "cpu_ms_per_mib",
                "daemon_rss_mib", "file_transfer_skipped"):  # fmt: skip
        if key in res:
            out.print(f"{key}: {res[key]}", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=30, help="echo round trips timed (30)")
    p.add_argument("--stream-mib", type=int, default=256, help="MiB written to stdout (256)")
    p.add_argument("--variants", default="text,zeros,random",
                   help="stdout kinds to time: text, zeros, random (all)")  # fmt: skip
    p.add_argument("--file-mib", type=int, default=100, help="MiB uploaded and read back (100)")
    p.add_argument("--rss-secs", type=int, default=30, help="seconds of RSS samples (30)")
    p.add_argument("--rss-gib", type=int, default=1, help="GiB the unread process writes (1)")
    p.add_argument("--memory", type=int, default=512, help="sandbox memory in MiB (512)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(WRITERS):  # none at all is fine: not timed
        p.error(f"--variants: unknown {sorted(unknown)}; known: {sorted(WRITERS)}")
    if args.samples < 1 or args.stream_mib < 1 or min(args.file_mib, args.rss_secs) < 0:
        p.error("--samples and --stream-mib must be at least 1, the others at least 0")
    return benchlib.run_main(
        benchlib.amain(args, StreamBench, finish_results, render, workdir_prefix="forkd-stream-")
    )


if __name__ == "__main__":
    sys.exit(main())
