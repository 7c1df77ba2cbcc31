"""``forkd gateway`` over three real daemons and a real registry on loopback: the SDK
pointed at the gateway unchanged; children placed, spread and moved between nodes; a
branch taken on one node forked on another; terminals and output streams through the
proxy; a gateway restart; a node killed mid-run."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.client import Controller, ControllerError, Sandbox, Snapshot
from forkd.launcher import GatewayProcess
from tests import oci_images
from tests.integration.conftest import Daemon
from tests.integration.test_container_image_lifecycle import shell_less_image
from tests.registry_server import RegistryServer

pytestmark = pytest.mark.integration

GATEWAY_TOKEN = "gateway-token-0123456789"
NODE_CAP = 3  # sandboxes per node: a fork of 5 must spread


@dataclass
class Fleet:
    nodes: list[Daemon]
    gateway: GatewayProcess
    registry: RegistryServer
    ids: list[str]  # each node's id, in the order of ``nodes``

    def ctl(self) -> Controller:
        return Controller(self.gateway.url, token=GATEWAY_TOKEN, timeout=600)

    def get(self, path: str) -> Any:
        r = httpx.get(self.gateway.url + path, headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"})
        r.raise_for_status()
        return r.json()


def _node_of(sandbox_id: str) -> str:
    return sandbox_id.split("-")[1]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    root = Path(tempfile.mkdtemp(prefix="forkd-gw-", dir="/tmp"))
    registry = RegistryServer()
    nodes = []
    for i in range(3):
        (root / f"node{i}").mkdir()
        nodes.append(Daemon(root / f"node{i}"))
        nodes[-1].start(
            "--kill-on-exit",
            "--max-sandboxes",
            str(NODE_CAP),
            "--insecure-registry",
            registry.address,
        )
    (root / "gateway-token").write_text(GATEWAY_TOKEN + "\n")
    (root / "gw").mkdir()
    gateway = GatewayProcess(
        root / "gw", [d.url for d in nodes], nodes[0].root / "token", root / "gateway-token"
    )
    gateway.start("--registry", f"{registry.address}/forkd/fleet")
    headers = {"Authorization": f"Bearer {Daemon.token}"}
    ids = [httpx.get(f"{d.url}/v1/capacity", headers=headers).json()["node_id"] for d in nodes]
    try:
        yield Fleet(nodes, gateway, registry, ids)
    finally:
        gateway.stop()
        for d in nodes:
            if d.proc is not None:
                d.stop()
            d.kill_leftovers()
        registry.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_sdk_works_through_the_gateway_and_children_move(fleet: Fleet) -> None:
    a, b, _c = fleet.ids
    nodes = fleet.get("/v1/nodes")
    assert {n["node_id"] for n in nodes} == set(fleet.ids)
    assert all(n["state"] == "up" and n["capacity"]["accel"] for n in nodes)
    with fleet.ctl() as ctl:
        snap = Snapshot.create(
            "gw-py", controller=ctl, memory_mib=256, node=a, setup=["echo ready > /tmp/setup.txt"]
        )
        assert snap.tag == "gw-py"
        # Two children pinned on a node without the snapshot: it moves there first.
        kids = snap.fork(2, node=b)
        try:
            assert {_node_of(k.id) for k in kids} == {b}
            run = kids[0].commands.run(["cat", "/tmp/setup.txt"])  # an SSE stream, proxied
            assert run.exit_code == 0 and run.stdout.strip() == "ready"
            with kids[0].pty.create(cmd=["cat"]) as term:  # a WebSocket, proxied
                term.send_stdin("over-the-gateway\n")
                seen = b""
                deadline = time.monotonic() + 30
                while b"over-the-gateway" not in seen and time.monotonic() < deadline:
                    seen += term.read(timeout=1) or b""
                term.kill()
            assert b"over-the-gateway" in seen
            listed = {s["id"]: s["node"] for s in ctl.list_sandboxes()}
            assert listed[kids[0].id] == b and listed[kids[1].id] == b
            held = {s["tag"]: set(s["nodes"]) for s in ctl.list_snapshots()}
            assert held["gw-py"] == {a, b}
        finally:
            for kid in kids:
                kid.kill()


def test_a_branch_on_one_node_forks_on_another(fleet: Fleet) -> None:
    _a, b, c = fleet.ids
    with fleet.ctl() as ctl, Sandbox("gw-py", controller=ctl, node=b) as parent:
        assert _node_of(parent.id) == b
        want = parent.eval(
            "import os, hashlib; blob = os.urandom(1 << 20); hashlib.sha256(blob).hexdigest()"
        ).result
        branch = parent.branch(tag="gw-branch")
        with Sandbox(branch.tag, controller=ctl, node=c) as child:
            assert _node_of(child.id) == c
            assert child.eval("hashlib.sha256(blob).hexdigest()").result == want
        ctl.delete_snapshot("gw-branch")  # on every node holding it
        assert "gw-branch" not in {s["tag"] for s in ctl.list_snapshots()}


def test_a_fork_bigger_than_one_node_spreads_and_one_too_big_is_429(fleet: Fleet) -> None:
    with fleet.ctl() as ctl:
        kids = Snapshot("gw-py", controller=ctl).fork(5)
        try:
            per_node: dict[str, int] = {}
            for k in kids:
                per_node[_node_of(k.id)] = per_node.get(_node_of(k.id), 0) + 1
            assert len(per_node) >= 2 and max(per_node.values()) <= NODE_CAP
            with pytest.raises(ControllerError) as exc:
                Snapshot("gw-py", controller=ctl).fork(3 * NODE_CAP)
            assert exc.value.status == 429
            assert len(ctl.list_sandboxes()) == 5  # the refused fork started nothing
        finally:
            for k in kids:
                k.kill()


def test_an_image_sent_through_the_gateway_makes_a_template_and_is_deleted_everywhere(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The nodes here share one image cache (one host), so each lists what one of them
    loaded: where a template goes among nodes that differ is the unit tests' part."""
    _a, b, _c = fleet.ids
    archive = oci_images.write_oci_archive(tmp_path / "bare.tar", {"bare": shell_less_image()})
    r = httpx.post(
        f"{fleet.gateway.url}/v1/images/load",
        params={"node": b, "tag": "bare:1"},
        content=archive.read_bytes(),
        timeout=600,
        headers={"Authorization": f"Bearer {GATEWAY_TOKEN}", "Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text
    name = r.json()["name"]
    assert b in [i["node"] for i in fleet.get("/v1/images") if i["name"] == name]
    assert b in fleet.get(f"/v1/images/{name}")["nodes"]
    with fleet.ctl() as ctl:
        ctl.create_snapshot("gw-bare", image="bare:1", memory_mib=256)  # a node holding it
        (node,) = {s["tag"]: s["nodes"] for s in ctl.list_snapshots()}["gw-bare"]
        (kid,) = ctl.spawn_sandboxes("gw-bare", n=1)
        assert _node_of(kid["id"]) == node
        assert ctl.exec_command(kid["id"], ["ls", "/bin"])["stdout"].split() == [
            "busybox",
            "cat",
            "ls",
        ]
        with pytest.raises(ControllerError) as exc:  # its template boots from it
            ctl.delete_image(name)
        assert exc.value.status == 409 and f"on node {node}" in str(exc.value)
        ctl.kill_sandbox(kid["id"])
        ctl.delete_snapshot("gw-bare")
        ctl.delete_image(name)
        assert name not in {i["name"] for i in ctl.list_images()}


def test_a_restarted_gateway_relearns_everything(fleet: Fleet) -> None:
    with fleet.ctl() as ctl:
        kid = Snapshot("gw-py", controller=ctl).fork(1)[0]
    fleet.gateway.stop()
    fleet.gateway.start("--registry", f"{fleet.registry.address}/forkd/fleet")
    with fleet.ctl() as ctl:
        assert kid.id in {s["id"] for s in ctl.list_sandboxes()}
        again = Sandbox.connect(kid.id, controller=ctl)
        assert again.commands.run(["true"]).exit_code == 0
        again.kill()


def test_a_node_killed_mid_run_is_down_within_10_s_and_only_its_sandboxes_fail(
    fleet: Fleet,
) -> None:
    a, _b, c = fleet.ids
    with fleet.ctl() as ctl:
        on_a = Snapshot("gw-py", controller=ctl).fork(1, node=a)[0]
        on_c = Snapshot("gw-py", controller=ctl).fork(1, node=c)[0]
        victim = fleet.nodes[2]
        assert victim.proc is not None
        victim.proc.kill()  # no goodbye: its VMs run on, its API is gone
        killed = time.monotonic()
        while next(n for n in fleet.get("/v1/nodes") if n["node_id"] == c)["state"] != "down":
            assert time.monotonic() - killed < 10, "the node was not marked down within 10 s"
            time.sleep(0.2)
        metrics = httpx.get(
            f"{fleet.gateway.url}/metrics", headers={"Authorization": f"Bearer {GATEWAY_TOKEN}"}
        ).text
        assert 'forkd_gateway_nodes{state="down"} 1' in metrics
        with pytest.raises(ControllerError) as exc:
            ctl.exec_command(on_c.id, ["true"])
        assert exc.value.status == 503 and c in str(exc.value)
        assert ctl.exec_command(on_a.id, ["true"])["exit_code"] == 0
        kids = Snapshot("gw-py", controller=ctl).fork(2)  # placed on the live nodes only
        assert c not in {_node_of(k.id) for k in kids}
        for k in [*kids, on_a]:
            k.kill()
        victim.proc = None
