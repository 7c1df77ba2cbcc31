"""The gateway's fork across nodes, over fake nodes (httpx's MockTransport): all or
nothing, a snapshot moved to a node that lacks it, and a fork nobody has room for."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from forkd.errors import Conflict, OverCapacity
from forkd.gateway.fleet_ops import FleetOps
from forkd.gateway.nodes import Node, NodeSet
from forkd.gateway.proxy import Forwarder


class FakeNodes:
    """Nodes a and b answering the routes a fork uses; ``refuse`` makes a node's forks 429."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.refuse: set[str] = set()
        self.held = {"a": {"py"}, "b": set()}
        self.seq = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        node, path = request.url.host, request.url.path
        self.calls.append((node, request.method, path))
        body = json.loads(request.content or b"{}")
        if request.method == "GET" and path.startswith("/v1/snapshots/"):
            return httpx.Response(200, json={"tag": "py", "memory_mib": 256})
        if path == "/v1/snapshots/py/push":
            return httpx.Response(200, json={"digest": "sha256:" + "a" * 64})
        if path == "/v1/snapshots/pull":
            assert body["ref"] == "127.0.0.1:5000/f@sha256:" + "a" * 64 and body["tag"] == "py"
            self.held[node].add("py")
            return httpx.Response(201, json={"tag": "py"})
        if request.method == "POST" and path == "/v1/sandboxes":
            if node in self.refuse:
                return httpx.Response(429, json={"error": f"node {node} is full"})
            kids = []
            for _ in range(body["n"]):
                self.seq += 1
                kids.append({"id": f"sb-{node}{node}{node}-{self.seq:04d}"})
            return httpx.Response(201, json=kids)
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(404, json={"error": "no such route"})


def _ops(fake: FakeNodes, free: dict[str, int]) -> FleetOps:
    nodes = NodeSet([], "node-token")
    for name, room in free.items():
        capacity = {
            "node_id": name * 3,
            "sandboxes": 0,
            "max_sandboxes": room,
            "snapshots": sorted(fake.held[name]),
        }
        nodes.nodes[f"http://{name}"] = Node(f"http://{name}", name * 3, capacity, time.monotonic())
    forward = Forwarder(nodes, transport=httpx.MockTransport(fake.handle))
    return FleetOps(nodes, forward, registry="127.0.0.1:5000/f")


def _run(ops: FleetOps, body: dict[str, Any]) -> Any:
    async def go() -> Any:
        try:
            return await ops.fork(body)
        finally:
            await ops.forward.close()
            await ops.nodes.close()

    return asyncio.run(go())


def test_children_spread_and_the_snapshot_moves_to_the_node_lacking_it() -> None:
    fake = FakeNodes()
    answer = _run(_ops(fake, {"a": 2, "b": 5}), {"snapshot_tag": "py", "n": 4})
    assert answer.status_code == 201
    ids = [k["id"] for k in json.loads(answer.body)]
    assert sorted(i.split("-")[1] for i in ids) == ["aaa", "aaa", "bbb", "bbb"]
    assert ("a", "POST", "/v1/snapshots/py/push") in fake.calls  # pushed by its holder
    assert ("b", "POST", "/v1/snapshots/pull") in fake.calls  # pulled by the target
    assert fake.calls.index(("b", "POST", "/v1/snapshots/pull")) < fake.calls.index(
        ("b", "POST", "/v1/sandboxes")
    )


def test_a_node_refusing_its_part_takes_the_whole_fork_back() -> None:
    fake = FakeNodes()
    fake.held["b"].add("py")
    fake.refuse.add("b")
    answer = _run(_ops(fake, {"a": 2, "b": 2}), {"snapshot_tag": "py", "n": 4})
    assert answer.status_code == 429 and b"node b is full" in answer.body
    deleted = [path for node, method, path in fake.calls if method == "DELETE"]
    assert sorted(deleted) == ["/v1/sandboxes/sb-aaa-0001", "/v1/sandboxes/sb-aaa-0002"]


def test_a_fork_no_set_of_nodes_has_room_for_starts_nothing() -> None:
    fake = FakeNodes()
    with pytest.raises(OverCapacity, match="room for 3 more"):
        _run(_ops(fake, {"a": 1, "b": 2}), {"snapshot_tag": "py", "n": 4})
    assert not [c for c in fake.calls if c[1] == "POST"]


class NodesBehindAProxy(FakeNodes):
    """A push answered by something that is not a forkd daemon: a proxy's error page."""

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/snapshots/py/push":
            self.calls.append((request.url.host, request.method, request.url.path))
            return httpx.Response(502, text="<h1>SECRET-upstream-3b7e</h1>")
        return super().handle(request)


def test_a_move_that_fails_says_the_nodes_error_or_its_status_never_another_body() -> None:
    fake = NodesBehindAProxy()
    with pytest.raises(Conflict) as exc:
        _run(_ops(fake, {"a": 2, "b": 5}), {"snapshot_tag": "py", "n": 4})
    assert str(exc.value) == "moving 'py' from aaa (http://a): push: answered 502"
    assert not [c for c in fake.calls if c[2] == "/v1/snapshots/pull"]
