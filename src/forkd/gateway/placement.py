"""Where N children go: nodes with room, those holding the snapshot first.

A pinned node takes them all (its daemon answers 429 when it has no room).
Otherwise holders of the snapshot are filled first, the roomiest first, then
the other nodes, the roomiest first; a fork that no set of nodes has room for
is a 429 before anything starts. Room is what each node last reported, so two
gateways placing at once can overshoot: the daemons' own admission is the
final word, and a node that refuses fails the whole fork (nothing is left).
"""

from __future__ import annotations

from forkd.errors import OverCapacity, Unavailable
from forkd.gateway.nodes import Node


def place(
    up: list[Node], holders: list[Node], n: int, memory_mib: int, pinned: Node | None = None
) -> list[tuple[Node, int]]:
    """``[(node, count), ...]`` adding up to ``n``."""
    if pinned is not None:
        if not pinned.up:
            raise Unavailable(f"node {pinned.name} is down")
        return [(pinned, n)]
    if not up:
        raise Unavailable("no node is up")
    held = {id(node) for node in holders}
    order = sorted(up, key=lambda node: (id(node) not in held, -node.free(memory_mib), node.url))
    plan: list[tuple[Node, int]] = []
    left = n
    for node in order:
        take = min(node.free(memory_mib), left)
        if take > 0:
            plan.append((node, take))
            left -= take
        if left == 0:
            return plan
    room = n - left
    raise OverCapacity(
        f"the nodes have room for {room} more children of {memory_mib} MiB, not {n} "
        f"({len(up)} nodes up)"
    )
