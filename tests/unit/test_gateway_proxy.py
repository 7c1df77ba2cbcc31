"""The gateway's proxy over a fake node (httpx's MockTransport): paths, queries and
headers pass through exactly, a node's refusal of an event filter is the answer, and a
node that cannot be reached is a 503 naming it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from forkd.gateway.app import create_app
from forkd.gateway.nodes import Node, NodeSet

TOKEN = "gateway-unit-token"


class EndlessEvent(httpx.AsyncByteStream):
    """One event, then one whose data never ends."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"event: created\ndata: {}\n\ndata: "
        while True:
            yield b"x" * 65536


class FakeNode:
    def __init__(self) -> None:
        self.seen: list[httpx.Request] = []
        self.reachable = True

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.reachable and request.url.path != "/v1/capacity":
            raise httpx.ConnectError("refused", request=request)
        self.seen.append(request)
        if request.url.path == "/v1/capacity":
            return httpx.Response(200, json={"node_id": "aaa", "snapshots": []})
        if request.url.path == "/v1/events" and request.url.params.get("type") == "bogus":
            return httpx.Response(400, json={"error": "unknown event type 'bogus'"})
        if request.url.path == "/v1/events":
            return httpx.Response(
                200, headers={"Content-Type": "text/event-stream"}, stream=EndlessEvent()
            )
        headers = [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("X-Node", "aaa")]
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(b"node answer"))


@pytest.fixture
def fake() -> FakeNode:
    return FakeNode()


@pytest.fixture
def client(fake: FakeNode) -> Iterator[TestClient]:
    transport = httpx.MockTransport(fake.handle)
    nodes = NodeSet(["http://aaa.node"], "node-token", transport=transport)
    app = create_app(nodes, TOKEN, transport=transport)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_the_path_query_and_headers_pass_through_exactly(client: TestClient, fake: FakeNode):
    r = client.get(
        "/v1/sandboxes/sb-aaa-0001/files?path=/w/100%2541&x=1&x=2", headers={"Set-Thing": "kept"}
    )
    assert r.status_code == 200 and r.content == b"node answer"
    sent = fake.seen[-1]
    assert sent.url.raw_path == b"/v1/sandboxes/sb-aaa-0001/files?path=/w/100%2541&x=1&x=2"
    assert sent.headers["Authorization"] == "Bearer node-token"  # never the client's
    assert sent.headers["Accept-Encoding"] != "gzip, deflate, zstd"
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]


def test_a_node_refusing_an_event_filter_is_the_answer(client: TestClient) -> None:
    r = client.get("/v1/events?type=bogus")
    assert r.status_code == 400 and "bogus" in r.json()["error"]


def test_a_node_that_cannot_be_reached_is_a_503_naming_it(
    client: TestClient, fake: FakeNode
) -> None:
    fake.reachable = False
    r = client.post("/v1/sandboxes/sb-aaa-0001/exec", json={"args": ["true"]})
    assert r.status_code == 503 and "aaa" in r.json()["error"]
    r = client.post("/v1/snapshots/pull", json={"ref": "r.io/a:b"})
    assert r.status_code == 503 and "aaa" in r.json()["error"]


def test_a_tag_one_node_holds_cannot_be_made_on_another(client: TestClient) -> None:
    ops: Any = client.app.state.ops  # type: ignore[attr-defined]
    node: Node = ops.nodes.nodes["http://aaa.node"]
    node.capacity["snapshots"] = ["py"]
    node.last_ok = time.monotonic()
    r = client.post("/v1/snapshots", json={"tag": "py"})
    assert r.status_code == 409 and "already exists on node aaa" in r.json()["error"]


def test_a_node_event_that_never_ends_ends_the_merged_stream(client: TestClient) -> None:
    """A node's stream is merged an event at a time: one over the bound ends the merge
    (the client reconnects), instead of growing in the gateway's memory."""
    r = client.get("/v1/events")
    assert r.status_code == 200
    assert r.content == b": merged from every node\n\nevent: created\ndata: {}\n\n"
