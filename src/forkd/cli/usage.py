"""``forkd metrics ID``: what one sandbox uses; ``forkd top``: every sandbox of the
daemon (or gateway), sorted by memory or CPU, refreshed until Ctrl-C (``forkd top ID``:
one sandbox's processes, forkd.cli.processes)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from forkd.cli import processes, render
from forkd.cli.failures import daemon_errors
from forkd.cli.options import Connection, with_connection
from forkd.cli.render import cell, out
from forkd.states import SandboxState

if TYPE_CHECKING:
    import httpx

MIB = 1 << 20
SORTS = ("memory", "cpu")


def register(app: typer.Typer, *, transport: httpx.BaseTransport | None = None) -> None:
    """Add ``metrics`` and ``top`` to ``app``; ``transport`` is for tests."""
    app.command("metrics")(with_connection(metrics, transport=transport))
    app.command("top")(with_connection(top, transport=transport))


def metrics(
    conn: Connection,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="The sandbox.")],
) -> None:
    """Show what a sandbox uses: CPU, memory, disk, volumes, network, processes."""
    with daemon_errors(), conn.controller() as ctl:
        figures = ctl.sandbox_metrics(sandbox_id)
    if conn.as_json:
        render.print_json(figures)
        return
    out.print(metrics_table(figures))


def top(
    conn: Connection,
    sandbox_id: Annotated[
        str | None,
        typer.Argument(metavar="[ID]", help="A sandbox: list its processes instead."),
    ] = None,
    sort: Annotated[
        str, typer.Option("--sort", help="memory (host memory it holds) or cpu.")
    ] = "memory",
    once: Annotated[bool, typer.Option("--once", help="Print the table once and exit.")] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.5, help="Seconds between refreshes.")
    ] = 2.0,
    limit: Annotated[int, typer.Option("-n", min=1, help="Show this many sandboxes.")] = 30,
) -> None:
    """Every sandbox's CPU and memory, the busiest first, refreshed until Ctrl-C; with
    an ID, that sandbox's processes."""
    if sandbox_id is not None:
        processes.show_processes(conn, sandbox_id)
        return
    if sort not in SORTS:
        raise typer.BadParameter(f"--sort must be {' or '.join(SORTS)}, not {sort!r}")
    with daemon_errors(), conn.controller() as ctl:
        if once or conn.as_json:
            listed = ctl.list_sandbox_metrics()
            if conn.as_json:
                render.print_json(sorted_by(listed, sort))
            else:
                out.print(top_table(listed, sort, limit))
            return
        if not out.is_terminal:  # a pipe or a log: a table each --interval, one after another
            try:
                while True:
                    out.print(top_table(ctl.list_sandbox_metrics(), sort, limit))
                    sys.stdout.flush()
                    time.sleep(interval)
            except (KeyboardInterrupt, BrokenPipeError):
                return
        with Live(top_table(ctl.list_sandbox_metrics(), sort, limit), console=out) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(top_table(ctl.list_sandbox_metrics(), sort, limit))
            except KeyboardInterrupt:
                pass


def sorted_by(listed: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    if sort == "cpu":
        return sorted(listed, key=lambda m: -((m.get("cpu") or {}).get("percent") or 0))
    return sorted(listed, key=lambda m: -((m.get("memory") or {}).get("host_private_bytes") or 0))


def top_table(listed: list[dict[str, Any]], sort: str, limit: int) -> Table:
    running = [m for m in listed if m.get("state") in (SandboxState.RUNNING, SandboxState.PAUSED)]
    held = sum((m.get("memory") or {}).get("host_private_bytes") or 0 for m in running)
    cpu = sum((m.get("cpu") or {}).get("percent") or 0 for m in running)
    table = Table(
        title=f"{len(listed)} sandboxes, {len(running)} with a VM: {held / MIB:.0f} MiB of "
        f"host memory, {cpu:.0f}% CPU (of one core); by {sort}"
    )
    table.add_column("sandbox", no_wrap=True)  # ids stay whole, to copy
    for name in (
        "state",
        "cpu %",
        "host MiB",
        "guest MiB",
        "disk MiB",
        "net KiB in/out",
        "procs",
        "woken/evicted",
    ):
        table.add_column(name, overflow="fold")
    for m in sorted_by(listed, sort)[:limit]:
        memory, disk, net = m.get("memory") or {}, m.get("disk") or {}, m.get("network")
        table.add_row(
            cell(m.get("sandbox_id")),
            cell(m.get("state")),
            _num((m.get("cpu") or {}).get("percent"), "{:.1f}"),
            _mib(memory.get("host_private_bytes")),
            _mib(memory.get("guest_used_bytes")),
            _mib(disk.get("used_bytes")),
            f"{net['rx_bytes'] >> 10}/{net['tx_bytes'] >> 10}" if net else "-",
            _num(m.get("processes")),
            f"{m.get('wakes', 0)}/{m.get('evictions', 0)}",
        )
    return table


def metrics_table(m: dict[str, Any]) -> Table:
    cpu, memory = m.get("cpu") or {}, m.get("memory") or {}
    table = Table("figure", "value", title=f"{m.get('sandbox_id')} ({m.get('state')})")
    rows = [
        (
            "CPU",
            f"{_num(cpu.get('percent'), '{:.1f}')}% of a host core, "
            f"{_num(cpu.get('seconds'), '{:.1f}')} s in all, {_num(cpu.get('count'))} vCPU",
        ),
        (
            "memory, guest",
            f"{_mib(memory.get('guest_used_bytes'))} of "
            f"{_mib(memory.get('guest_total_bytes'))} MiB used",
        ),
        (
            "memory, host",
            f"{_mib(memory.get('host_private_bytes'))} MiB its own, "
            f"{_mib(memory.get('host_proportional_bytes'))} MiB PSS",
        ),
    ]
    disk = m.get("disk")
    if disk:
        rows.append(("disk", f"{_mib(disk['used_bytes'])} of {_mib(disk['total_bytes'])} MiB"))
    for v in m.get("volumes") or []:
        rows.append(
            (
                f"volume {v['name']} ({v['path']})",
                f"{_mib(v['used_bytes'])} of {_mib(v['total_bytes'])} MiB",
            )
        )
    net = m.get("network")
    if net:
        rows.append(("network", f"{net['rx_bytes']} bytes in, {net['tx_bytes']} out"))
    rows += [
        ("processes", _num(m.get("processes"))),
        ("last active", str(m.get("last_active_at") or "-")),
        ("woken, evicted", f"{m.get('wakes', 0)}, {m.get('evictions', 0)}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)
