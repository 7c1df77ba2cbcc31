"""E2B port benchmark: E2B's own SDKs against forkd's E2B port, beside forkd's own SDK on
the same daemon, side by side in one run.

Run from the repository root::

    python bench/e2b_port.py            # table on stdout, then one JSON line
    python bench/e2b_port.py --json-only

It starts its own ``forkd serve --e2b-bind`` (a temporary state dir), builds a template
of the ``python`` image, and times, ``--samples`` times each way, alternating:

1. ``create_ms``: a sandbox made from the template and answered (E2B's
   ``Sandbox.create`` / forkd's ``Sandbox(...)``), then killed (not timed);
2. ``command_ms``: ``commands.run("true")`` until its result is back (E2B's: a
   Connect stream of process events; forkd's: its exec), both as E2B's SDK runs every
   command, in ``/bin/bash -l -c``;
3. ``file_ms``: a ``--file-kib`` KiB file written and read back;
4. ``code_ms``: ``run_code("1 + 1")`` (e2b_code_interpreter) / ``sb.eval("1 + 1")``.

(Named e2b_port.py, not e2b.py: a file ``e2b.py`` here would shadow E2B's own package
``e2b`` wherever bench/ is on the import path, this script's run and mypy's.)

Each figure is the p50 in ms, with ``ratio`` = E2B's / forkd's; the target is a ratio of
at most 1.3 (the E2B port adds at most 30% to what forkd's own API costs).
bench/README.md says what each figure is. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from benchlib import percentile, r1
from forkd.client import Sandbox
from forkd.launcher import free_port

TEMPLATE = "bench-e2b"
E2B_SHELL = ["/bin/bash", "-l", "-c"]
TARGET_RATIO = 1.3
FIGURES = ("create_ms", "command_ms", "file_ms", "code_ms")


class E2BBench(benchlib.DaemonBench):
    def _time(self, name: str, e2b_way: Callable[[], None], forkd_way: Callable[[], None]) -> None:
        """p50 of each way, alternating, ``--samples`` times (one warm-up each first)."""
        e2b_way()
        forkd_way()
        times: dict[str, list[float]] = {"e2b": [], "forkd": []}
        for _ in range(self.args.samples):
            for way, run in (("e2b", e2b_way), ("forkd", forkd_way)):
                started = time.perf_counter()
                run()
                times[way].append((time.perf_counter() - started) * 1000)
        e2b_ms, forkd_ms = (percentile(times[w], 50) for w in ("e2b", "forkd"))
        self.results[name] = {
            "e2b": r1(e2b_ms),
            "forkd": r1(forkd_ms),
            "ratio": round(e2b_ms / forkd_ms, 2) if forkd_ms else None,
        }
        self.say.log(f"{name}: {self.results[name]}")

    def bench(self) -> None:
        import e2b
        from e2b_code_interpreter import Sandbox as CodeSandbox

        address = f"127.0.0.1:{free_port()}"
        self.daemon.start("--e2b-bind", address)
        token = self.daemon.token_path.read_text().strip()
        os.environ.update(
            E2B_API_URL=f"http://{address}", E2B_SANDBOX_URL=f"http://{address}", E2B_API_KEY=token
        )
        self.say.log(f"daemon {self.daemon.url}, E2B port {address}, template {TEMPLATE!r}")
        payload = os.urandom(self.args.file_kib << 10)
        with self.controller() as ctl:
            ctl.create_snapshot(TEMPLATE, image="python", memory_mib=self.args.memory)

            def e2b_create() -> None:
                e2b.Sandbox.create(TEMPLATE).kill()

            def forkd_create() -> None:
                Sandbox(TEMPLATE, controller=ctl).kill()

            self._time("create_ms", e2b_create, forkd_create)
            theirs = CodeSandbox.create(TEMPLATE, timeout=600)
            ours = Sandbox(TEMPLATE, controller=ctl)
            try:
                self._time(
                    "command_ms",
                    lambda: _equal(theirs.commands.run("true").exit_code, 0),
                    # The same program: E2B's SDK runs every command as bash -l -c.
                    lambda: _equal(ours.commands.run([*E2B_SHELL, "true"]).exit_code, 0),
                )

                def e2b_file() -> None:
                    theirs.files.write("/tmp/bench.bin", payload)
                    _equal(bytes(theirs.files.read("/tmp/bench.bin", format="bytes")), payload)

                def forkd_file() -> None:
                    ours.files.write("/tmp/bench.bin", payload)
                    _equal(ours.files.read("/tmp/bench.bin"), payload)

                self._time("file_ms", e2b_file, forkd_file)
                self._time(
                    "code_ms",
                    lambda: _equal(theirs.run_code("1 + 1").text, "2"),
                    lambda: _equal(ours.eval("1 + 1").result, "2"),
                )
            finally:
                theirs.kill()
                ours.kill()


def _equal(got: Any, want: Any) -> None:
    if got != want:
        raise RuntimeError(f"expected {want!r:.60}, got {got!r:.60}")


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["targets"] = {
        f"{name}_ratio": {
            "value": results.get(name, {}).get("ratio"),
            "target": f"<= {TARGET_RATIO}",
            "met": (results.get(name, {}).get("ratio") or 99) <= TARGET_RATIO,
        }
        for name in FIGURES
    }
    results["samples"], results["host_cores"] = args.samples, os.cpu_count()
    return results


def render(out: Console, bench: E2BBench, res: dict[str, Any]) -> None:
    title = f"E2B's SDKs vs forkd's on one daemon ({res.get('accel')}, {res['host_cores']} cores)"
    out.print(benchlib.targets_table(title, res["targets"]))
    for name in FIGURES:
        if name in res:
            out.print(f"{name}: {res[name]}", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=10, help="timed runs of each way (10)")
    p.add_argument("--file-kib", type=int, default=256, help="KiB written and read (256)")
    p.add_argument("--memory", type=int, default=256, help="sandbox memory in MiB (256)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.samples < 1 or args.file_kib < 1:
        p.error("--samples and --file-kib must be at least 1")
    return benchlib.run_main(
        benchlib.amain(args, E2BBench, finish_results, render, workdir_prefix="forkd-e2b-")
    )


if __name__ == "__main__":
    sys.exit(main())
