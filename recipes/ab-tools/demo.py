#!/usr/bin/env python3
"""A/B tools: try two tools on the same workspace in parallel, keep the winner.

An agent that has prepared a workspace (a checkout, generated data, an
installed toolchain) often wants to compare two ways of doing the next step:
two search tools, two build flags, two formatters, two prompts for a
sub-agent. Running them one after the other in one sandbox means the first
run can change what the second one sees (caches, output files, side effects),
and preparing a second workspace from scratch costs the setup twice. Here the
agent branches its sandbox once the workspace is ready and forks one
grandchild per candidate: both start from the identical workspace, run at the
same time without seeing each other, and the agent keeps the sandbox of the
winner and kills the other. This demo compares ``grep -rn`` with ``rg -n``
(ripgrep, installed by this directory's image recipe) on a few thousand
generated files, and checks both find exactly the number of matches written.

Run: ``python recipes/ab-tools/demo.py`` (uses the daemon at ``FORKD_URL``, or
starts one for the duration of the demo; builds the ``ab-tools`` image from
``recipe.toml`` the first time).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd import Controller, ControllerError, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed
from forkd.guest import image as images

console = Console(highlight=False)

HERE = Path(__file__).resolve().parent
TREE = "/work/tree"
MARKER = "MARKER"
N_FILES = 3000
LINES_PER_FILE = 20
RUNS = 3  # each tool runs this many times; the best time counts

# Runs in the sandbox's warm interpreter: writes the workspace, returns how
# many lines hold MARKER. Lower-case decoys ("marker") must not match.
GENERATE = f"""\
import os

def make_tree(root, n_files, lines):
    hits = 0
    for i in range(n_files):
        d = os.path.join(root, f'pkg{{i % 40:02d}}', f'mod{{i % 7}}')
        os.makedirs(d, exist_ok=True)
        rows = []
        for j in range(lines):
            if (i * 31 + j * 7) % 23 == 0:
                rows.append(f'{{i}}:{{j}} {MARKER} fix this before release')
                hits += 1
            elif (i + j) % 11 == 0:
                rows.append(f'{{i}}:{{j}} a lower-case marker is not a match')
            else:
                rows.append(f'{{i}}:{{j}} nothing to see here')
        with open(os.path.join(d, f'f{{i:05d}}.txt'), 'w') as f:
            f.write('\\n'.join(rows) + '\\n')
    return hits

make_tree({TREE!r}, {N_FILES}, {LINES_PER_FILE})
"""

TOOLS = {
    "grep": f"grep -rn {MARKER} {TREE}",
    "ripgrep": f"rg -n {MARKER} {TREE}",
}
VERSION = {"grep": "grep --version | head -n1", "ripgrep": "rg --version | head -n1"}

# bash (not dash) for pipefail: a tool that fails must not pass as "0 matches".
BENCH = """\
set -o pipefail
for run in $(seq {runs}); do
    start=$(date +%s%N)
    n=$({cmd} | wc -l) || exit 1
    end=$(date +%s%N)
    echo "$n $(( (end - start) / 1000 ))"
done
"""


def expected_matches() -> int:
    """The number of MARKER lines the generator writes, computed here, not in the guest."""
    return sum(
        1 for i in range(N_FILES) for j in range(LINES_PER_FILE) if (i * 31 + j * 7) % 23 == 0
    )


def bench(sb: Sandbox, tool: str) -> dict[str, Any]:
    """Run one tool RUNS times in ``sb``, timed inside the guest."""
    script = BENCH.format(runs=RUNS, cmd=TOOLS[tool])
    res = sb.commands.run(["bash", "-c", script], timeout=300)
    version = sb.commands.run(["bash", "-c", VERSION[tool]]).stdout.strip().rpartition(" ")[2]
    out: dict[str, Any] = {"tool": tool, "sandbox": sb, "version": version, "ok": res.ok}
    if not res.ok:
        out["error"] = f"exit {res.exit_code}: {res.stderr.strip()[-300:]}"
        return out
    runs = [line.split() for line in res.stdout.splitlines()]
    out["counts"] = {int(n) for n, _ in runs}
    out["times_ms"] = [int(us) / 1000 for _, us in runs]
    out["best_ms"] = min(out["times_ms"])
    return out


def run(ctl: Controller, check: Checks) -> None:
    prefix = f"ab-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    expected = expected_matches()
    try:
        console.print(f"[bold]image[/] from {HERE / 'recipe.toml'} (built once, then cached)")
        img, img_ms = timed(
            lambda: images.build(
                recipe_dir=HERE, progress=lambda msg: console.print(f"  [dim]image:[/] {msg}")
            )
        )
        console.print(f"  image {img.name} ({img.key}) ready in {ms(img_ms)}")

        status = f"building template {prefix} from image {img.name}"
        template, build_ms = create_template(ctl, prefix, console, status, snaps, image=img.name)
        console.print(
            f"[bold]template[/] {prefix}: image {img.name}, "
            f"{template.info.get('memory_mib', '?')} MiB, ready in {ms(build_ms)}"
        )

        (work,), fork_ms = timed(lambda: template.fork(1))
        made.append(work)
        console.print(f"[bold]{work.id}[/]: forked in {ms(fork_ms)}")
        with console.status(f"generating {N_FILES} files in {work.id}"):
            gen, gen_ms = timed(lambda: work.eval(GENERATE))
        if not gen.ok:
            raise RuntimeError(f"generating the workspace failed: {gen.error}")
        files = work.commands.run(f"find {TREE} -type f | wc -l").stdout.strip()
        console.print(
            f"[bold]{work.id}[/]: workspace {TREE}: {files} files, "
            f"{gen.result} lines with {MARKER}, generated in {ms(gen_ms)}"
        )
        check(f"workspace has {N_FILES} files", files == str(N_FILES), files)
        check(
            f"generator wrote the known number of {MARKER} lines ({expected})",
            gen.result == str(expected),
            f"got {gen.result}",
        )

        branch, branch_ms = timed(lambda: work.branch(tag=f"{prefix}-workspace"))
        snaps.append(branch)
        console.print(
            f"[bold]branch[/] {branch.tag}: pause {ms(branch.pause_ms)} ({ms(branch_ms)} wall)"
        )
        kids, kids_ms = timed(lambda: branch.fork(len(TOOLS)))
        made += kids
        console.print(f"forked {len(kids)} grandchildren in {ms(kids_ms)}: one per tool")

        with (
            console.status("running grep and rg at the same time, one per sandbox"),
            ThreadPoolExecutor(len(TOOLS)) as pool,
        ):
            results = list(pool.map(bench, kids, TOOLS))

        table = Table(
            "tool", "sandbox", "version", "matches", f"best of {RUNS}", "all runs", title="A/B"
        )
        for r in results:
            table.add_row(
                r["tool"],
                r["sandbox"].id,
                r["version"],
                ", ".join(str(c) for c in sorted(r.get("counts", []))) or "-",
                ms(r.get("best_ms")),
                " ".join(f"{t:.0f}" for t in r.get("times_ms", [])),
            )
        console.print(table)
        for r in results:
            check(f"{r['tool']} ran", r["ok"], r.get("error", ""))
            check(
                f"{r['tool']} found {expected} matches (every run)",
                r.get("counts") == {expected},
                f"got {sorted(r.get('counts', []))}",
            )
        counts = [r.get("counts") for r in results]
        check("both tools report the same match count", counts[0] == counts[1], str(counts))
        if not all(r["ok"] for r in results):
            return

        winner, loser = sorted(results, key=lambda r: r["best_ms"])
        console.print(
            f"[bold]winner[/]: {winner['tool']} ({ms(winner['best_ms'])} vs "
            f"{ms(loser['best_ms'])}); keeping {winner['sandbox'].id}, "
            f"killing {loser['sandbox'].id}"
        )
        loser["sandbox"].kill()
        try:
            ctl.get_sandbox(loser["sandbox"].id)
            gone = False
        except ControllerError as exc:
            gone = exc.status == 404
        check(f"loser {loser['tool']} ({loser['sandbox'].id}) killed", gone)

        keep: Sandbox = winner["sandbox"]
        keep.files.write("/work/TOOL", winner["tool"] + "\n")
        sub = keep.commands.run(
            ["bash", "-c", f"set -o pipefail; {TOOLS[winner['tool']]}/pkg00 | wc -l"]
        )
        sub_expected = sum(
            1
            for i in range(0, N_FILES, 40)
            for j in range(LINES_PER_FILE)
            if (i * 31 + j * 7) % 23 == 0
        )
        check(
            f"work continues with {winner['tool']} in {keep.id} ({sub_expected} hits in pkg00)",
            sub.ok and sub.stdout.strip() == str(sub_expected),
            f"exit {sub.exit_code}: {sub.stdout!r} {sub.stderr!r}",
        )
    finally:
        cleanup(made, snaps, console, report=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args()
    return run_checks(args.url, console, run)


if __name__ == "__main__":
    sys.exit(main())
