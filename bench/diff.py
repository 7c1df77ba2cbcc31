"""Diff benchmark: what ``GET /v1/sandboxes/{id}/diff`` costs on a large tree.

Run from the repository root::

    python bench/diff.py                 # table on stdout, then one JSON line
    python bench/diff.py --json-only     # only the JSON line

It starts its own ``forkd serve``, builds a template of the ``python`` image
whose setup writes ``--files`` files (100 000 by default) under
``/work/tree``, forks a child that modifies, adds and removes ``--changed``
files each, and measures through the SDK:

- ``diff_first_ms``: the first diff of ``/work`` against the template: the
  snapshot's side is read then, by a child forked of it and killed at once;
- ``diff_ms_p50``: the same diff again (the snapshot's side kept), ``--repeat``
  times: the child's agent walks what its overlay holds, which is the whole
  tree the template wrote plus the changes;
- ``diff_subdir_ms_p50``: a diff of one directory of the tree (1/100 of it);
- ``diff_image_tree_ms_p50``: a diff of ``/usr`` (the image's own files, which
  the sandbox never wrote: nothing to walk);
- ``diff_sibling_ms_p50``: against a sibling sandbox (both sides read live);
- ``patch_ms`` and ``tar_ms``, ``tar_bytes``: the patch and the tar of the changes;
- ``naive_ms_p50``: what a client does without it: ``find -printf`` of the
  tree's path, size and mtime in the child and in a fresh fork of the template,
  each into a file in ``/dev/shm`` read back whole, compared on the client
  (``naive_bytes``: what it moved).

Each diff must list exactly the changes made. bench/README.md says more. The last
line of stdout is one JSON object.
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

from forkd.client import Controller

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
import benchlib
from benchlib import judge, percentile, r1

TEMPLATE = "diff-bench"
DIRS = 100
# The template's setup: --files small files in DIRS directories (no shell quoting: argv).
MAKE_TREE = (
    "import os, sys\n"
    "n = int(sys.argv[1])\n"
    "for i in range(n):\n"
    "    d = f'/work/tree/d{i % 100:02d}'\n"
    "    os.makedirs(d, exist_ok=True)\n"
    "    with open(f'{d}/f{i:06d}.txt', 'w') as f:\n"
    "        f.write(f'file {i}\\n' * 4)\n"
)
# The child's changes: --changed files modified, added and removed each.
CHANGE = (
    "import os, sys\n"
    "k = int(sys.argv[1])\n"
    "for i in range(k):\n"
    "    with open(f'/work/tree/d{i % 100:02d}/f{i:06d}.txt', 'a') as f:\n"
    "        f.write('edited\\n')\n"
    "    os.remove(f'/work/tree/d{(i + k) % 100:02d}/f{i + k:06d}.txt')\n"
    "    with open(f'/work/tree/d{i % 100:02d}/new{i:04d}.txt', 'w') as f:\n"
    "        f.write('added\\n')\n"
)
# Listed into a file outside the overlay (exec's output stops at 1 MiB), then read whole.
LISTING = "/dev/shm/forkd-bench-listing"
FIND_SH = ["sh", "-c", f"find /work/tree -printf '%p %s %T@\\n' > {LISTING}"]
TARGETS = {  # name: (metric key, comparison, bound)
    # A diff does no more than the naive listing of both sides, compared by the client.
    "diff_vs_naive": ("diff_vs_naive", "<=", 1.0),
}


def timed_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    value = fn()
    return value, (time.monotonic() - started) * 1000


class DiffBench(benchlib.DaemonBench):
    def expected(self) -> set[tuple[str, str]]:
        k = self.args.changed
        out = set()
        for i in range(k):
            out.add((f"/work/tree/d{i % DIRS:02d}/f{i:06d}.txt", "modified"))
            out.add((f"/work/tree/d{(i + k) % DIRS:02d}/f{i + k:06d}.txt", "removed"))
            out.add((f"/work/tree/d{i % DIRS:02d}/new{i:04d}.txt", "added"))
        return out

    def check(self, what: str, res: Any, expected: set[tuple[str, str]]) -> None:
        got = {(c.path, c.change) for c in res.changes}
        if got != expected:
            raise RuntimeError(f"{what}: {len(got ^ expected)} changes differ from those made")

    def repeat(self, fn: Callable[[], Any]) -> float:
        return percentile([timed_ms(fn)[1] for _ in range(self.args.repeat)], 50)

    def timed_diff(
        self, ctl: Controller, sid: str, path: str, want: set[tuple[str, str]], against: str | None
    ) -> float:
        """p50 of --repeat diffs of ``path``, each checked to list ``want``."""
        return self.repeat(
            lambda: self.check(f"the diff of {path}", ctl.diff_sandbox(sid, path, against), want)
        )

    def setup(self, ctl: Controller) -> tuple[str, str]:
        files = self.args.files
        self.say.log(f"template {TEMPLATE!r}: {files} files under /work/tree")
        setup = f"python3 -c {_quote(MAKE_TREE)} {files}"
        _, took = timed_ms(lambda: ctl.create_snapshot(
            TEMPLATE, image="python", memory_mib=self.args.memory, setup=[setup]
        ))  # fmt: skip
        self.results["template_s"] = r1(took / 1000)
        child, sibling = (k["id"] for k in ctl.spawn_sandboxes(TEMPLATE, n=2))
        ran = ctl.exec_command(child, ["python3", "-c", CHANGE, str(self.args.changed)],
                               timeout_secs=600)  # fmt: skip
        if ran["exit_code"] != 0:
            raise RuntimeError(f"changing the child's files failed: {ran['stderr'][-500:]}")
        return child, sibling

    def listing(self, ctl: Controller, sid: str) -> str:
        ran = ctl.exec_command(sid, FIND_SH, timeout_secs=600)
        if ran["exit_code"] != 0:
            raise RuntimeError(f"find failed: {ran['stderr'][-300:]}")
        return ctl.read_file(sid, LISTING).decode()

    def naive(self, ctl: Controller, child: str) -> float:
        """``find`` of the tree in the child and in a fresh fork, compared here."""
        (fresh,) = (k["id"] for k in ctl.spawn_sandboxes(TEMPLATE))
        moved = 0

        def once() -> None:
            nonlocal moved
            a, b = (self.listing(ctl, sid) for sid in (fresh, child))
            moved = len(a) + len(b)
            _ = set(a.splitlines()) ^ set(b.splitlines())  # the comparison, timed too

        try:
            return self.repeat(once)
        finally:
            self.results["naive_bytes"] = moved
            ctl.kill_sandbox(fresh)

    def bench(self) -> None:
        self.daemon.start()
        self.say.log(f"daemon {self.daemon.url}")
        expected = self.expected()
        with self.controller(timeout=1800) as ctl:
            child, sibling = self.setup(ctl)
            res, first = timed_ms(lambda: ctl.diff_sandbox(child, "/work"))
            self.check("the first diff", res, expected)
            self.results["diff_first_ms"] = r1(first)
            sub = {c for c in expected if c[0].startswith("/work/tree/d00/")}
            for key, path, want, against in (
                ("diff_ms_p50", "/work", expected, None),
                ("diff_subdir_ms_p50", "/work/tree/d00", sub, None),
                ("diff_image_tree_ms_p50", "/usr", set(), None),
                ("diff_sibling_ms_p50", "/work", expected, sibling),
            ):
                self.results[key] = r1(self.timed_diff(ctl, child, path, want, against))
            patch, took = timed_ms(lambda: ctl.diff_patch(child, "/work"))
            self.results.update(patch_ms=r1(took), patch_bytes=len(patch))
            tar, took = timed_ms(lambda: ctl.diff_tar(child, "/work"))
            self.results.update(tar_ms=r1(took), tar_bytes=len(tar))
            self.results["naive_ms_p50"] = r1(self.naive(ctl, child))
        self.results["diff_vs_naive"] = round(
            self.results["diff_ms_p50"] / max(self.results["naive_ms_p50"], 0.001), 3
        )


def _quote(code: str) -> str:
    """``code`` as one single-quoted shell word (the template's setup runs in sh)."""
    return "'" + code.replace("'", "'\\''") + "'"


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["targets"] = judge(results, TARGETS)
    results.update(files=args.files, changed_each=args.changed, memory_mib=args.memory,
                   host_cores=os.cpu_count())  # fmt: skip
    return results


def render(out: Console, bench: DiffBench, res: dict[str, Any]) -> None:
    title = f"forkd diff on {res['files']} files ({res.get('accel')}, {res['host_cores']} cores)"
    t = benchlib.targets_table(title, res["targets"])
    for key in ("template_s", "diff_first_ms", "diff_ms_p50", "diff_subdir_ms_p50",
                "diff_image_tree_ms_p50", "diff_sibling_ms_p50", "patch_ms", "patch_bytes",
                "tar_ms", "tar_bytes", "naive_ms_p50", "naive_bytes"):  # fmt: skip
        t.add_row(key, str(res.get(key)), "", "")
    out.print(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=100_000, help="files in the tree (100000)")
    p.add_argument("--changed", type=int, default=10,
                   help="files modified, added and removed each (10)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=5, help="runs of each timed diff (5)")
    p.add_argument("--memory", type=int, default=1024, help="template RAM in MiB (1024)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.files < 2 * args.changed or args.changed < 1 or args.repeat < 1:
        p.error("--files must be at least twice --changed, --changed and --repeat at least 1")
    return benchlib.run_main(
        benchlib.amain(args, DiffBench, finish_results, render, workdir_prefix="forkd-diff-")
    )


if __name__ == "__main__":
    sys.exit(main())
