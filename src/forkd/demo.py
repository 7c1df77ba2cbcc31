"""The forkd demo: template → children → branch → grandchildren, with timings.

Run it with ``./dev.sh demo`` (installs everything first) or
``python -m forkd.demo`` once forkd is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from forkd.guest import image as images
from forkd.vmm.vm import VM

console = Console()


def ms(value: float) -> str:
    return f"{value:,.0f} ms"


async def val(vm: VM, code: str) -> str | None:
    """Evaluate ``code`` in the VM's warm interpreter; raise if it failed."""
    res = await vm.eval(code)
    if res["error"]:
        raise RuntimeError(f"eval in {vm.id} failed:\n{res['error']}")
    return res["result"]


async def run_demo(children: int, memory_mib: int, work: Path) -> None:
    run_root, snap_root = work / "run", work / "snapshots"
    run_root.mkdir()
    snap_root.mkdir()
    vms: list[VM] = []
    try:
        with console.status("guest image"):
            img = await asyncio.to_thread(images.build, "python")
        console.print(f"[bold]image[/] {img.name}-{img.key} ({img.size_bytes() >> 20} MiB)")

        with console.status(f"booting a {memory_mib} MiB template VM"):
            template = await VM.boot(img, run_root=run_root, memory_mib=memory_mib)
        vms.append(template)
        accel = template.machine.accel
        console.print(f"[bold]template[/] booted in {ms(template.ready_ms or 0)} ({accel})")

        await val(
            template,
            "import json, sqlite3, statistics\n"
            "db = sqlite3.connect(':memory:')\n"
            "db.execute('create table notes(body text)')\n"
            "db.execute(\"insert into notes values ('warmed up in the template')\")\n"
            "counter = 0",
        )
        await template.write_file("/work/README.txt", b"written in the template\n")
        console.print("  warmed: imports, an in-memory database, counter = 0, /work/README.txt")

        started = time.monotonic()
        base = await template.snapshot(snap_root / "template")
        snap_ms = (time.monotonic() - started) * 1000
        alloc = (base / "memory.bin").stat().st_blocks * 512 >> 20
        console.print(
            f"[bold]snapshot[/] written in {ms(snap_ms)} (memory.bin {alloc} MiB on disk)"
        )

        kids: list[VM] = []
        with console.status(f"forking {children} children"):
            for _ in range(children):
                kids.append(await VM.restore(base, run_root=run_root))
                vms.append(kids[-1])
        table = Table("child", "fork", "counter", "random.random()", "os.urandom(4)")
        for kid in kids:
            counter = await val(kid, "counter")
            rnd = await val(kid, "import random; round(random.random(), 6)")
            urnd = await val(kid, "import os; os.urandom(4).hex()")
            table.add_row(kid.id, ms(kid.ready_ms or 0), counter, rnd, urnd)
        console.print(table)
        fork_ms = sorted(k.ready_ms or 0 for k in kids)[len(kids) // 2]
        boot_ms = template.ready_ms or 0
        console.print(
            f"  median fork {ms(fork_ms)} vs cold boot {ms(boot_ms)}: "
            f"[bold]{boot_ms / fork_ms:.0f}x faster[/]"
        )

        source = kids[0]
        await val(source, "counter += 1; db.execute(\"insert into notes values ('child work')\")")
        await source.write_file("/work/plan.txt", b"step 1 done in the child\n")
        console.print(f"[bold]{source.id}[/] did some work: counter = 1, a row, /work/plan.txt")

        branch = await source.snapshot(snap_root / "branch-1")
        pause_ms = float(json.loads((branch / "snapshot.json").read_text())["pause_ms"])
        console.print(
            f"[bold]branch[/] of {source.id}: paused {ms(pause_ms)}, then it kept running"
        )

        strategies = {
            "retry": "counter += 10; 'retried'",
            "rewrite": "db.execute('delete from notes'); counter = 0; 'rewrote'",
            "explore": "counter += 100; statistics.mean([1, 2, 3, 4])",
        }
        grandkids: list[tuple[str, VM]] = []
        with console.status("forking 3 grandchildren from the branch"):
            for name in strategies:
                g = await VM.restore(branch, run_root=run_root)
                vms.append(g)
                grandkids.append((name, g))

        tree = Tree(f"template ({base.name})")
        child_node = tree.add(f"{source.id} → branch {branch.name} (pause {ms(pause_ms)})")
        for name, g in grandkids:
            outcome = await val(g, strategies[name])
            counter = await val(g, "counter")
            rows = await val(g, "db.execute('select count(*) from notes').fetchone()[0]")
            plan = (await g.read_file("/work/plan.txt")).decode().strip()
            child_node.add(
                f"{g.id} [{name}] fork {ms(g.ready_ms or 0)}: result={outcome} "
                f"counter={counter} rows={rows} plan={plan!r}"
            )
        src_counter = await val(source, "counter")
        child_node.add(f"{source.id} itself, still running: counter={src_counter}")
        for kid in kids[1:]:
            tree.add(f"{kid.id}: counter={await val(kid, 'counter')}")
        console.print(tree)
        console.print(
            "Each grandchild started from the child's exact state at the branch and went "
            "its own way; the child, its siblings and the template are untouched."
        )
    finally:
        with console.status("stopping VMs"):
            await asyncio.gather(*(vm.kill() for vm in vms), return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forkd-demo-", dir="/tmp"))
    try:
        asyncio.run(run_demo(args.children, args.memory, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
