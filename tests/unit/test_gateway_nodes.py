"""The gateway's view of its nodes, without daemons: placement, liveness, DNS discovery
(a resolver stub), and which node a sandbox id names."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from forkd.errors import NotFound, OverCapacity, Unavailable
from forkd.gateway import nodes as nodes_mod
from forkd.gateway.fleet_ops import FleetOps
from forkd.gateway.nodes import Node, NodeSet
from forkd.gateway.placement import place


def _node(
    url: str,
    node_id: str,
    sandboxes: int = 0,
    cap: int = 10,
    mib: int = 0,
    mem_cap: int | None = None,
    snapshots: tuple[str, ...] = (),
) -> Node:
    capacity = {
        "node_id": node_id,
        "sandboxes": sandboxes,
        "max_sandboxes": cap,
        "guest_memory_mib": mib,
        "max_guest_memory_mib": mem_cap,
        "snapshots": list(snapshots),
    }
    return Node(url, node_id, capacity, last_ok=time.monotonic())


def test_placement_fills_holders_first_then_the_roomiest() -> None:
    a = _node("http://a", "aaa", sandboxes=8, snapshots=("py",))  # 2 free, holds it
    b = _node("http://b", "bbb", sandboxes=0)  # 10 free
    c = _node("http://c", "ccc", sandboxes=5)  # 5 free
    plan = place([a, b, c], [a], 7, 256)
    assert [(n.node_id, k) for n, k in plan] == [("aaa", 2), ("bbb", 5)]
    assert [(n.node_id, k) for n, k in place([a, b, c], [a], 1, 256)] == [("aaa", 1)]


def test_placement_counts_memory_and_refuses_what_does_not_fit() -> None:
    a = _node("http://a", "aaa", mib=900, mem_cap=1024)  # 124 MiB left: no 256 MiB child
    b = _node("http://b", "bbb", mib=0, mem_cap=1024)  # 4 of 256 MiB
    assert [(n.node_id, k) for n, k in place([a, b], [], 4, 256)] == [("bbb", 4)]
    with pytest.raises(OverCapacity, match="room for 4 more children of 256 MiB, not 5"):
        place([a, b], [], 5, 256)


def test_a_pinned_node_takes_all_and_a_down_one_none() -> None:
    a, b = _node("http://a", "aaa", cap=1), _node("http://b", "bbb")
    assert place([a, b], [], 3, 256, pinned=a) == [(a, 3)]  # its daemon answers 429
    a.failures = nodes_mod.FAILURES_DOWN
    with pytest.raises(Unavailable, match="is down"):
        place([b], [], 1, 256, pinned=a)
    with pytest.raises(Unavailable, match="no node is up"):
        place([], [], 1, 256)


def _capacity_answers(answers: dict[str, Any]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        answer = answers.get(request.url.host)
        if answer is None:
            raise httpx.ConnectError("refused", request=request)
        assert request.headers["Authorization"] == "Bearer node-token"
        return httpx.Response(200, json=answer)

    return httpx.MockTransport(handle)


def test_nodes_are_up_while_they_answer_and_down_after() -> None:
    answers = {"a": {"node_id": "aaa", "snapshots": ["py"]}, "b": {"node_id": "bbb"}}

    async def run() -> None:
        ns = NodeSet(
            ["http://a:1", "http://b:1/"], "node-token", transport=_capacity_answers(answers)
        )
        await ns.refresh()
        assert {n.node_id for n in ns.up()} == {"aaa", "bbb"}
        assert [n.node_id for n in ns.holders("py")] == ["aaa"]
        del answers["b"]
        await ns.refresh()
        b = ns.by_id("bbb")
        assert b is not None and b.up and b.error  # one miss is not down yet
        await ns.refresh()
        assert not b.up and b.view()["state"] == "down"
        assert [n.node_id for n in ns.up()] == ["aaa"]
        answers["b"] = {"node_id": "bbb"}
        await ns.refresh()
        assert b.up and b.error is None  # back
        await ns.close()

    asyncio.run(run())


def test_nodes_found_in_dns_come_and_go() -> None:
    found = ["10.9.0.1", "10.9.0.2"]
    answers = {"10.9.0.1": {"node_id": "n1"}, "10.9.0.2": {"node_id": "n2"}}

    def resolver(name: str) -> list[str]:
        assert name == "forkd-nodes.forkd.svc"
        if not found:
            raise OSError("no such name")
        return list(found)

    async def run() -> None:
        ns = NodeSet(
            [],
            "node-token",
            dns_name="forkd-nodes.forkd.svc",
            dns_port=8889,
            resolver=resolver,
            transport=_capacity_answers(answers),
        )
        await ns.refresh()
        assert sorted(ns.nodes) == ["http://10.9.0.1:8889", "http://10.9.0.2:8889"]
        assert {n.node_id for n in ns.up()} == {"n1", "n2"}
        found.remove("10.9.0.2")
        await ns.refresh()
        assert sorted(ns.nodes) == ["http://10.9.0.1:8889"]
        found.clear()  # a DNS failure keeps what was known
        await ns.refresh()
        assert sorted(ns.nodes) == ["http://10.9.0.1:8889"]
        await ns.close()

    asyncio.run(run())


def test_a_sandbox_id_names_its_node() -> None:
    a = _node("http://a", "1a2b3c")
    ns = NodeSet([], None)
    ns.nodes = {a.url: a}
    ops = FleetOps(ns, forward=None)  # type: ignore[arg-type]
    assert ops.owner("sb-1a2b3c-0007") is a
    with pytest.raises(Unavailable, match="node 'ffffff', which is not up"):
        ops.owner("sb-ffffff-0001")
    for bad in ("nope", "sb--1", "sb"):
        with pytest.raises(NotFound):
            ops.owner(bad)
    asyncio.run(ns.close())
