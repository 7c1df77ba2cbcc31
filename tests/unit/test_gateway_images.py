"""The gateway's image routes over two fake nodes (httpx's MockTransport): lists merged
with each image's node, imports and archives sent to the chosen node, a template made
where its image is, and a delete that is all or nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from forkd.gateway.app import create_app
from forkd.gateway.image_placement import holds
from forkd.gateway.nodes import NodeSet

TOKEN = "gateway-unit-token"
APP = {
    "name": "oci-111111111111",
    "key": "k1",
    "kind": "container",
    "references": ["loaded:app:1"],
    "used_by": [],
}
PYTHON = {"name": "python", "key": "k2", "kind": "recipe", "references": [], "used_by": []}
WEB = {
    "name": "oci-222222222222",
    "key": "k3",
    "kind": "container",
    "references": ["registry.example.com/team/web:1"],
    "used_by": [],
}
TOOLS = {"name": "tools", "key": "k4", "kind": "recipe", "references": [], "used_by": []}
OLD_PYTHON = {**PYTHON, "key": "k0", "used_by": ["snapshot old"]}  # an older build, in use


class FakeNodes:
    """Nodes aaa (room for 10) and bbb (room for 50), each with its images."""

    def __init__(self) -> None:
        self.images: dict[str, list[dict[str, Any]]] = {
            "aaa": [APP, PYTHON, WEB, TOOLS],
            "bbb": [PYTHON, OLD_PYTHON, {**WEB, "used_by": ["snapshot web"]}, TOOLS],
        }
        self.room = {"aaa": 10, "bbb": 50}
        self.seen: list[tuple[str, str, str, bytes]] = []  # node, method, path, body

    def handle(self, request: httpx.Request) -> httpx.Response:
        node, path, method = request.url.host.split(".")[0], request.url.path, request.method
        if path == "/v1/capacity":
            room = self.room[node]
            return httpx.Response(
                200, json={"node_id": node, "sandboxes": 0, "max_sandboxes": room, "snapshots": []}
            )
        self.seen.append((node, method, path, request.read()))
        if path == "/v1/images" and method == "GET":
            return httpx.Response(200, json=self.images[node])
        if path.startswith("/v1/images/") and method in ("GET", "DELETE"):
            name = path.removeprefix("/v1/images/")
            if name == "BAD":
                return httpx.Response(400, json={"error": "not an image name: 'BAD'"})
            info = next((i for i in self.images[node] if i["name"] == name), None)
            if info is None:
                return httpx.Response(404, json={"error": f"no image {name!r}"})
            if method == "DELETE":  # every build of the name
                self.images[node] = [i for i in self.images[node] if i["name"] != name]
                return httpx.Response(204)
            return httpx.Response(200, json=info)
        if path in ("/v1/images", "/v1/images/load"):
            events = b'event: progress\ndata: {"message": "on ' + node.encode() + b'"}\n\n'
            return httpx.Response(
                200, headers={"Content-Type": "text/event-stream"}, stream=httpx.ByteStream(events)
            )
        if path == "/v1/snapshots":
            return httpx.Response(201, json={"tag": json.loads(request.content)["tag"]})
        return httpx.Response(404, json={"error": "no such route"})

    def sent(self, method: str, path: str) -> list[str]:
        """The nodes ``method path`` reached, in order."""
        return [node for node, m, p, _ in self.seen if (m, p) == (method, path)]


@pytest.fixture
def fake() -> FakeNodes:
    return FakeNodes()


@pytest.fixture
def client(fake: FakeNodes) -> Iterator[TestClient]:
    transport = httpx.MockTransport(fake.handle)
    nodes = NodeSet(["http://aaa.node", "http://bbb.node"], "node-token", transport=transport)
    app = create_app(nodes, TOKEN, transport=transport)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


def test_the_list_has_every_node_s_images_each_with_its_node(client: TestClient) -> None:
    listed = client.get("/v1/images").json()
    assert sorted((i["name"], i["key"], i["node"]) for i in listed) == [
        ("oci-111111111111", "k1", "aaa"),
        ("oci-222222222222", "k3", "aaa"),
        ("oci-222222222222", "k3", "bbb"),
        ("python", "k0", "bbb"),
        ("python", "k2", "aaa"),
        ("python", "k2", "bbb"),
        ("tools", "k4", "aaa"),
        ("tools", "k4", "bbb"),
    ]


def test_one_image_names_the_nodes_holding_it(client: TestClient) -> None:
    info = client.get("/v1/images/python").json()
    assert info["name"] == "python" and info["node"] == "aaa" and info["nodes"] == ["aaa", "bbb"]
    assert client.get("/v1/images/oci-111111111111").json()["nodes"] == ["aaa"]
    r = client.get("/v1/images/oci-999999999999")
    assert r.status_code == 404 and "any node" in r.json()["error"]
    r = client.get("/v1/images/BAD")  # the node's own refusal of the name
    assert r.status_code == 400 and "BAD" in r.json()["error"]


@pytest.mark.parametrize(
    ("image", "node"),
    [
        ("app:1", "aaa"),  # a loaded image, by NAME:TAG: only aaa holds it
        ("oci-111111111111", "aaa"),  # by name
        ("oci-111111111111-k1", "aaa"),  # by NAME-KEY
        ("python", "bbb"),  # both hold it: the roomier
        ("registry.example.com/team/web:1", "bbb"),  # imported on both: the roomier
        ("registry.example.com/team/other:1", "bbb"),  # nowhere yet: the roomiest imports it
    ],
)
def test_a_template_is_made_where_its_image_is(
    client: TestClient, fake: FakeNodes, image: str, node: str
) -> None:
    r = client.post("/v1/snapshots", json={"tag": "t", "image": image})
    assert r.status_code == 201
    assert fake.sent("POST", "/v1/snapshots") == [node]


def test_a_pinned_node_makes_the_template_whatever_it_holds(
    client: TestClient, fake: FakeNodes
) -> None:
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "python", "node": "aaa"})
    assert r.status_code == 201 and fake.sent("POST", "/v1/snapshots") == ["aaa"]
    assert fake.sent("GET", "/v1/images") == []  # no need to ask
    assert json.loads(fake.seen[-1][3]) == {"tag": "t", "image": "python"}  # node not passed on


def test_an_import_goes_to_the_node_asked_for_else_the_roomiest(
    client: TestClient, fake: FakeNodes
) -> None:
    with client.stream(
        "POST",
        "/v1/images?node=aaa",
        json={"ref": "r.io/a:1"},
        headers={"Accept": "text/event-stream"},
    ) as r:
        assert r.status_code == 200 and b'"on aaa"' in r.read()
    r = client.post("/v1/images", json={"ref": "r.io/a:1"})
    assert b'"on bbb"' in r.content
    assert fake.sent("POST", "/v1/images") == ["aaa", "bbb"]
    assert client.post("/v1/images?node=zzz", json={"ref": "r.io/a:1"}).status_code == 404


def test_an_archive_streams_through_to_the_node(client: TestClient, fake: FakeNodes) -> None:
    archive = bytes(range(256)) * 4096  # 1 MiB
    r = client.post(
        "/v1/images/load?node=aaa&tag=app:2",
        content=archive,
        headers={"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 200
    node, _, path, body = fake.seen[-1]
    assert (node, path, body) == ("aaa", "/v1/images/load", archive)


def test_a_delete_in_use_on_any_node_deletes_nothing(client: TestClient, fake: FakeNodes) -> None:
    r = client.delete("/v1/images/oci-222222222222")
    assert r.status_code == 409
    assert "snapshot web on node bbb" in r.json()["error"]
    # Its current build is unused everywhere; an older one on bbb, which a node's delete
    # also takes, is not.
    r = client.delete("/v1/images/python")
    assert r.status_code == 409 and "snapshot old on node bbb" in r.json()["error"]
    assert fake.sent("DELETE", "/v1/images/oci-222222222222") == []
    assert fake.sent("DELETE", "/v1/images/python") == []
    assert client.delete("/v1/images/tools").status_code == 204
    assert fake.sent("DELETE", "/v1/images/tools") == ["aaa", "bbb"]
    assert client.get("/v1/images/tools").status_code == 404
    assert client.delete("/v1/images/tools").status_code == 404


def test_a_holder_without_room_does_not_get_the_template(
    client: TestClient, fake: FakeNodes
) -> None:
    fake.room["bbb"] = 0  # the roomier holder is full now
    ops = client.app.state.ops  # type: ignore[attr-defined]
    client.portal.call(ops.nodes.refresh)  # type: ignore[union-attr]
    image = "registry.example.com/team/web:1"
    assert client.post("/v1/snapshots", json={"tag": "t", "image": image}).status_code == 201
    assert fake.sent("POST", "/v1/snapshots") == ["aaa"]


def test_what_an_image_reference_matches() -> None:
    assert holds(APP, "app:1") and not holds(APP, "app:2") and not holds(APP, "app")
    latest = {**APP, "references": ["loaded:app:latest"]}
    assert holds(latest, "app") and holds(latest, "app:latest")
    assert not holds(WEB, "registry.example.com/team/web")  # not the tag it was imported as
    assert not holds("not an object", "app") and not holds({"references": "x"}, "x")
