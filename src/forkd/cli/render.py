"""How the CLI prints: its two consoles, table cells, tables and the lineage tree."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from forkd.states import SandboxState, SnapshotStatus

PIPE_WIDTH = 4096  # a pipe or a CI log: lines as long as what they hold, never cut


class _Console(Console):
    """A console that, writing to a pipe or a file, is as wide as what it prints (as
    ``docker ps`` is): a table's ids and names are never cut to 80 columns (or COLUMNS)
    or folded."""

    def __init__(self, **kwargs: Any) -> None:
        self._fixed_width = "width" in kwargs  # rich takes COLUMNS as if it were asked
        super().__init__(**kwargs)

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if not self._fixed_width and not self.is_terminal:
            return ConsoleDimensions(PIPE_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self.width, self.height = new_size  # what rich's own setter of size does


out = _Console()
err = _Console(stderr=True)


# What a terminal acts on instead of showing, in a string a guest or a registry chose
# (a file name, a command line, an image's label): C0 controls but tab and newline,
# DEL, C1, and the bidirectional controls that reorder what is shown around them.
_UNSHOWN = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (9, 10)}
_UNSHOWN |= {
    c: f"\\u{c:04x}" for c in (0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def shown(value: object) -> str:
    """``value`` as text for rich: its markup escaped, and what a terminal would act on
    (an escape sequence that sets the clipboard or clears the screen, say) written out
    as ``\\x1b``."""
    return escape(str(value).translate(_UNSHOWN))


def cell(value: Any) -> str:
    """A table cell: '-' for None, else :func:`shown`."""
    return "-" if value is None else shown(value)


def age(unix: Any, now: float | None = None) -> str:
    if not isinstance(unix, int | float):
        return "-"
    secs = max(0, int((time.time() if now is None else now) - unix))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit} ago"
    return f"{secs}s ago"


def byte_size(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def millis(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.0f} ms"


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def wrapping_table(*columns: str) -> Table:
    """A table whose cells wrap instead of being cut short: ids must stay copyable (in a
    pipe the console is wide enough that nothing wraps)."""
    table = Table()
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def kv_table(info: dict[str, Any]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in info.items():
        if key.endswith("_bytes"):
            text = f"{byte_size(value)} ({value})" if value is not None else "-"
        elif key == "created_at_unix":
            text = f"{value} ({age(value)})"
        elif key == "pause_ms":
            text = millis(value)
        elif isinstance(value, list | dict):
            text = shown(json.dumps(value))
        else:
            text = cell(value)
        table.add_row(shown(key), text)
    return table


def sandbox_table(sandboxes: list[dict[str, Any]]) -> Table:
    table = wrapping_table("id", "snapshot", "state", "pid", "created", "memory_limit")
    for sb in sandboxes:
        limit = sb.get("memory_limit_mib")
        table.add_row(
            cell(sb.get("id")),
            cell(sb.get("snapshot_tag")),
            cell(sb.get("state")),
            cell(sb.get("pid")),
            age(sb.get("created_at_unix")),
            f"{limit} MiB" if limit is not None else "-",
        )
    return table


def snapshot_label(info: dict[str, Any]) -> str:
    tag = shown(str(info.get("tag")))
    bits = []
    if info.get("branched_from"):
        bits.append(f"[bold magenta]{tag}[/] branch, paused {millis(info.get('pause_ms'))}")
    else:
        bits.append(f"[bold cyan]{tag}[/] snapshot")
    if info.get("memory_mib") is not None:
        bits.append(f"{info['memory_mib']} MiB")
    if info.get("image"):
        bits.append(shown(str(info["image"])))
    if info.get("status") not in (None, SnapshotStatus.READY):
        bits.append(f"[yellow]{shown(str(info['status']))}[/]")
    return "  ".join(bits + explore_bits(info))


def sandbox_label(sb: dict[str, Any]) -> str:
    state = sb.get("state") or "?"
    color = "green" if state == SandboxState.RUNNING else "yellow"
    bits = [f"[{color}]{shown(str(sb.get('id')))}[/] {shown(str(state))}"]
    if sb.get("pid") is not None:
        bits.append(f"pid {sb['pid']}")
    return "  ".join(bits + explore_bits(sb))


def explore_bits(info: dict[str, Any]) -> list[str]:
    """An explore's marks on a node of the lineage: its variant and score."""
    labels = info.get("metadata") or {}
    bits = []
    if "forkd.variant" in labels:
        bits.append(f"variant {shown(str(labels['forkd.variant']))}")
    elif "forkd.explore" in labels:
        bits.append("[dim]explore[/]")
    if "forkd.score" in labels:
        bits.append(f"[bold]score {shown(str(labels['forkd.score']))}[/]")
    return bits


LineageNode = tuple[str, str]  # ("snapshot", tag), ("sandbox", id) or ("missing", tag)


def lineage_forest(
    snapshots: list[dict[str, Any]], sandboxes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Nest snapshots and sandboxes into their lineage.

    A sandbox hangs under the snapshot it was forked from; a branch hangs under
    the live sandbox it was taken from, or under its parent snapshot when that
    sandbox is gone. Nodes: ``{"kind": "snapshot"|"sandbox"|"missing", "info",
    "children"}``.
    """
    snaps = {s["tag"]: s for s in snapshots if s.get("tag")}
    sbs = {s["id"]: s for s in sandboxes if s.get("id")}
    children, roots, missing = _lineage_links(snaps, sbs)
    infos = {"snapshot": snaps, "sandbox": sbs, "missing": missing}

    def build(node: LineageNode, seen: set[LineageNode]) -> dict[str, Any]:
        kind, key = node
        seen = seen | {node}
        kids = [build(c, seen) for c in children.get(node, []) if c not in seen]
        return {"kind": kind, "info": infos[kind][key], "children": kids}

    forest = [build(r, set()) for r in roots]
    # Anything unreachable from a root (a cycle in bad data) still shows up.
    placed: set[LineageNode] = set()
    for n in forest:
        _mark_placed(n, placed)
    for node in [("snapshot", t) for t in snaps] + [("sandbox", i) for i in sbs]:
        if node not in placed:
            forest.append(build(node, set()))
            _mark_placed(forest[-1], placed)
    return forest


def _lineage_links(
    snaps: dict[str, dict[str, Any]], sbs: dict[str, dict[str, Any]]
) -> tuple[dict[LineageNode, list[LineageNode]], list[LineageNode], dict[str, dict[str, Any]]]:
    """Each snapshot and sandbox under its parent, or a root: (children by parent, roots,
    the gone snapshots sandboxes were forked from, by tag)."""
    children: dict[LineageNode, list[LineageNode]] = {}
    roots: list[LineageNode] = []
    missing: dict[str, dict[str, Any]] = {}

    def attach(parent: LineageNode | None, node: LineageNode) -> None:
        if parent is None:
            roots.append(node)
        else:
            children.setdefault(parent, []).append(node)

    for tag, info in snaps.items():
        src, parent_tag = info.get("branched_from"), info.get("parent_tag")
        if src and src in sbs:
            attach(("sandbox", src), ("snapshot", tag))
        elif parent_tag and parent_tag in snaps and parent_tag != tag:
            attach(("snapshot", parent_tag), ("snapshot", tag))
        else:
            attach(None, ("snapshot", tag))
    for sid, sb in sbs.items():
        forked_from = sb.get("snapshot_tag")
        if forked_from is not None and forked_from in snaps:
            attach(("snapshot", forked_from), ("sandbox", sid))
        else:
            key = str(forked_from)
            if key not in missing:
                missing[key] = {"tag": forked_from}
                attach(None, ("missing", key))
            attach(("missing", key), ("sandbox", sid))
    return children, roots, missing


def _mark_placed(node: dict[str, Any], placed: set[LineageNode]) -> None:
    """``node`` and everything under it, as placed in the forest."""
    info = node["info"]
    placed.add((node["kind"], info.get("tag") if node["kind"] != "sandbox" else info.get("id")))
    for c in node["children"]:
        _mark_placed(c, placed)


def rich_tree(forest: list[dict[str, Any]], title: str = "forkd") -> Tree:
    root = Tree(f"[bold]{shown(title)}[/]")

    def add(parent: Tree, node: dict[str, Any], under: dict[str, Any] | None) -> None:
        info = node["info"]
        if node["kind"] == "snapshot":
            label = snapshot_label(info)
            src = info.get("branched_from")
            if src and not (
                under and under["kind"] == "sandbox" and under["info"].get("id") == src
            ):
                label += f"  [dim](from {shown(str(src))}, gone)[/]"
        elif node["kind"] == "sandbox":
            label = sandbox_label(info)
        else:
            label = f"[red]{shown(str(info.get('tag')))}[/] [dim](snapshot deleted)[/]"
        branch = parent.add(label)
        for child in node["children"]:
            add(branch, child, node)

    for node in forest:
        add(root, node, None)
    return root


def strip_forest(forest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The JSON form of a lineage forest."""
    return [
        {"kind": n["kind"], **n["info"], "children": strip_forest(n["children"])} for n in forest
    ]
