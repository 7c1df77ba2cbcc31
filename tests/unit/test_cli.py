"""The daemon commands of the CLI (forkd.cli) against the real daemon app over the fake VM driver.

The app runs under a real uvicorn on loopback (the ``server`` fixture); the
commands find it through ``FORKD_URL`` and ``FORKD_TOKEN_FILE`` or
``--url``/``--token-file``, as a user's would. Tests of what a command sent
read it from a :class:`~tests.unit.conftest.RecordingTransport`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from forkd import cli
from forkd.cli import render
from forkd.client import Controller
from forkd.controller.settings import Settings
from forkd.launcher import free_port
from tests.unit.conftest import Invoke, RecordingTransport, Server, env_of, make_app, runner

PAUSED = re.compile(r"paused \d+ ms")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FORKD_URL", "FORKD_TOKEN", "FORKD_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)


# -- exec and eval ----------------------------------------------------------------


def test_cli_exec_passes_exit_code(forkd: Invoke, sent: RecordingTransport, sid: str) -> None:
    res = forkd("exec", sid, "--", "echo", "hello", "-n")
    assert res.exit_code == 0, res.output
    assert res.stdout == "hello -n\n"
    assert sent.body(-2) == {"cmd": ["echo", "hello", "-n"], "stdin": False, "timeout_s": 30.0}

    res = forkd("exec", "--timeout", "5", sid, "--", "exit", "7")
    assert res.exit_code == 7
    assert res.stderr == "exit 7\n"
    assert sent.body(-2)["timeout_s"] == 5.0

    res = forkd("exec", sid, "--json", "--", "exit", "3")
    assert res.exit_code == 3
    assert json.loads(res.stdout)["exit_code"] == 3

    res = forkd("exec", "--timeout", "1", sid, "--", "sleep", "5")
    assert res.exit_code == 124


def test_cli_eval(forkd: Invoke, sid: str) -> None:
    res = forkd("eval", sid, "40+2")
    assert res.exit_code == 0 and res.stdout == "42\n"
    res = forkd("eval", sid, "1/0")
    assert res.exit_code == 1
    assert "ZeroDivisionError" in res.stderr and res.stdout == ""


# -- reaching the daemon ------------------------------------------------------------


def test_cli_error_404_and_unreachable(forkd: Invoke) -> None:
    res = forkd("exec", "sb-nope", "--", "true")
    assert res.exit_code == 1
    assert "error:" in res.stderr and "sandbox 'sb-nope' not found" in res.stderr
    res = forkd("snapshot", "info", "nope")
    assert res.exit_code == 1 and "snapshot 'nope' not found" in res.stderr

    url = f"http://127.0.0.1:{free_port()}"
    res = runner.invoke(cli.app, ["ps", "--url", url])
    assert res.exit_code == 2
    assert "not reachable" in res.stderr and "forkd serve" in res.stderr


def test_cli_token_file(server: Server, sent: RecordingTransport, tmp_path: Path) -> None:
    app = make_app(sent)
    res = runner.invoke(app, ["ps", "--url", server.url])
    assert res.exit_code == 1 and "bearer token" in res.stderr
    res = runner.invoke(
        app, ["ps", "--url", server.url, "--token-file", str(server.token_file), "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == []
    assert sent.last.headers["authorization"] == f"Bearer {server.token}"
    res = runner.invoke(app, ["ps", "--url", server.url, "--token-file", str(tmp_path / "no")])
    assert res.exit_code == 2 and "token file" in res.stderr


def test_the_forkd_command_finds_the_daemon(server: Server, py: str) -> None:
    res = runner.invoke(cli.app, ["snapshot", "ls", "--json"], env=env_of(server))
    assert res.exit_code == 0, res.output
    assert [s["tag"] for s in json.loads(res.stdout)] == ["py"]
    # Options given to the group reach its subcommands.
    args = ["snapshot", "--url", server.url, "--token-file", str(server.token_file), "--json"]
    res = runner.invoke(cli.app, [*args, "info", "py"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tag"] == "py"


# -- output ---------------------------------------------------------------------------


def test_cli_json_outputs_parse(forkd: Invoke, sent: RecordingTransport, py: str) -> None:
    res = forkd("fork", "--tag", "py", "-n", "3", "--memory-limit", "128", "--json")
    assert res.exit_code == 0, res.output
    kids = json.loads(res.stdout)
    assert len(kids) == 3 and all(k["snapshot_tag"] == "py" for k in kids)
    assert sent.body() == {"snapshot_tag": "py", "n": 3, "memory_limit_mib": 128}

    ps = json.loads(forkd("ps", "--json").stdout)
    assert {s["id"] for s in ps} == {k["id"] for k in kids}
    snaps = json.loads(forkd("snapshot", "ls", "--json").stdout)
    assert [s["tag"] for s in snaps] == ["py"]
    info = json.loads(forkd("snapshot", "info", "py", "--json").stdout)
    assert info["tag"] == "py" and info["chain_depth"] == 0

    res = forkd("snapshot", "--from-sandbox", kids[0]["id"], "--tag", "b1", "--json")
    assert res.exit_code == 0, res.output
    b = json.loads(res.stdout)
    assert b["tag"] == "b1" and b["branched_from"] == kids[0]["id"] and b["pause_ms"] >= 0

    res = forkd("branch", "--from-sandbox", kids[1]["id"], "-n", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["branch"]["branched_from"] == kids[1]["id"]
    assert [s["snapshot_tag"] for s in out["sandboxes"]] == [out["branch"]["tag"]] * 2

    forest = json.loads(forkd("tree", "--json").stdout)
    assert [n["tag"] for n in forest] == ["py"]
    sb_nodes = {c["id"]: c for c in forest[0]["children"] if c["kind"] == "sandbox"}
    assert set(sb_nodes) == {k["id"] for k in kids}
    b1 = sb_nodes[kids[0]["id"]]["children"]
    assert [(c["kind"], c["tag"]) for c in b1] == [("snapshot", "b1")]
    branch2 = sb_nodes[kids[1]["id"]]["children"][0]
    assert {c["id"] for c in branch2["children"]} == {s["id"] for s in out["sandboxes"]}

    res = forkd("rm", kids[0]["id"], "sb-nope", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout) == {
        "removed": [kids[0]["id"]],
        "failed": {"sb-nope": "sandbox 'sb-nope' not found"},
    }


def test_cli_tree_hangs_a_branch_of_a_killed_sandbox_under_its_parent(
    forkd: Invoke, ctl: Controller, sid: str
) -> None:
    ctl.branch_sandbox(sid, tag="b1")
    ctl.kill_sandbox(sid)
    forest = json.loads(forkd("tree", "--json").stdout)
    assert [(n["kind"], n["tag"]) for n in forest] == [("snapshot", "py")]
    assert [(c["kind"], c["tag"]) for c in forest[0]["children"]] == [("snapshot", "b1")]
    res = forkd("tree")
    assert res.exit_code == 0, res.output
    assert f"(from {sid}, gone)" in res.stdout


def test_snapshot_create_from_a_container_image(
    forkd: Invoke, sent: RecordingTransport, ctl: Controller
) -> None:
    """The CLI imports the reference, then names the imported image: the daemon finds it."""
    ref = "127.0.0.1:5000/team/web:1"  # one tests/unit/fake_images.py knows
    res = forkd(
        "snapshot", "create", "--tag", "web", "--image", ref, "--start", "--ready-cmd", "true"
    )
    assert res.exit_code == 0, res.output
    [image] = [i for i in ctl.list_images() if i["kind"] == "container"]
    assert sent.body()["image"] == image["name"] and sent.body()["start"] is True
    assert ctl.snapshot("web")["image"] == image["name"]
    # Issue 36, item 7: a taken tag is said before any import runs.
    imports = [r for r in sent.requests if r.url.path == "/v1/images"]
    res = forkd("snapshot", "create", "--tag", "web", "--image", "127.0.0.1:5000/team/other:1")
    assert res.exit_code == 1 and "snapshot web exists" in res.stderr
    assert [r for r in sent.requests if r.url.path == "/v1/images"] == imports


def test_cli_human_output(
    forkd: Invoke, sent: RecordingTransport, ctl: Controller, server: Server
) -> None:
    res = forkd("snapshot", "create", "--tag", "np", "--memory", "256", "--setup", "a")
    assert res.exit_code == 0, res.output
    assert sent.body() == {"tag": "np", "memory_mib": 256, "setup": ["a"]}
    assert "np" in res.stdout

    res = forkd("fork", "--tag", "np", "-n", "2")
    assert res.exit_code == 0, res.output
    ids = [s["id"] for s in ctl.list_sandboxes()]
    assert len(ids) == 2 and all(i in res.stdout for i in ids)

    res = forkd("snapshot", "--from-sandbox", ids[0], "--tag", "b1")
    assert res.exit_code == 0, res.output
    assert "b1" in res.stdout and PAUSED.search(res.stdout)

    res = forkd("branch", "--from-sandbox", ids[1], "-n", "1")
    assert res.exit_code == 0, res.output
    (grandkid,) = {s["id"] for s in ctl.list_sandboxes()} - set(ids)
    assert ids[1] in res.stdout and PAUSED.search(res.stdout) and grandkid in res.stdout

    res = forkd("ps")
    assert res.exit_code == 0 and all(i in res.stdout for i in [*ids, grandkid])
    res = forkd("snapshot", "ls")
    assert res.exit_code == 0 and "b1" in res.stdout and "np" in res.stdout
    for cmd in (("tree",), ("snapshot", "ls", "--tree")):
        res = forkd(*cmd)
        assert res.exit_code == 0, res.output
        assert "b1" in res.stdout and ids[0] in res.stdout and "np" in res.stdout
        assert server.url in res.stdout  # the tree's title

    res = forkd("rmi", "b1", "nope")
    assert res.exit_code == 1
    assert "deleted b1" in res.stdout and "snapshot 'nope' not found" in res.stderr
    res = forkd("rm", *ids, grandkid)
    assert res.exit_code == 0 and ctl.list_sandboxes() == []

    res = forkd("snapshot")  # no subcommand, no --from-sandbox: help
    assert res.exit_code == 0 and "create" in res.stdout


def test_cli_empty_lists_say_what_to_run(forkd: Invoke) -> None:
    res = forkd("ps")
    assert res.exit_code == 0 and "forkd fork --tag" in res.stderr
    res = forkd("snapshot", "ls")
    assert res.exit_code == 0 and "forkd snapshot create" in res.stderr


# -- the lineage forest ---------------------------------------------------------------


def test_lineage_forest_dead_source() -> None:
    snaps: list[dict[str, Any]] = [
        {"tag": "py"},
        {"tag": "b", "branched_from": "sb-gone", "parent_tag": "py"},
        {"tag": "orphan", "branched_from": "sb-gone2"},
    ]
    sbs = [{"id": "sb-2", "snapshot_tag": "b"}, {"id": "sb-3", "snapshot_tag": "deleted"}]
    forest = render.lineage_forest(snaps, sbs)
    flat = render.strip_forest(forest)
    assert [(n["kind"], n.get("tag")) for n in flat] == [
        ("snapshot", "py"),
        ("snapshot", "orphan"),
        ("missing", "deleted"),
    ]
    b = flat[0]["children"][0]
    assert b["tag"] == "b" and b["children"][0]["id"] == "sb-2"
    assert flat[2]["children"][0]["id"] == "sb-3"


# -- snapshot push and pull ---------------------------------------------------------


def test_cli_snapshot_push_and_pull_through_a_real_registry(
    forkd: Invoke, ctl: Controller, py: str, settings: Settings
) -> None:
    from tests.registry_server import RegistryServer

    registry = RegistryServer()
    settings.insecure_registries = (registry.address,)  # as forkd serve --insecure-registry
    try:
        ref = registry.ref("forkd/cli", "py")
        pushed = forkd("snapshot", "push", py, ref, "--json")
        assert pushed.exit_code == 0, pushed.output
        result = json.loads(pushed.stdout)
        assert result["digest"].startswith("sha256:") and result["encoding"] == "chunks"
        human = forkd("snapshot", "push", py, ref)  # again: nothing new goes up
        assert human.exit_code == 0 and result["digest"] in human.stdout
        pulled = forkd("snapshot", "pull", ref, "--tag", "py-again", "--json")
        assert pulled.exit_code == 0, pulled.output
        assert json.loads(pulled.stdout)["tag"] == "py-again"
        assert "py-again" in {s["tag"] for s in ctl.list_snapshots()}
        bad = forkd("snapshot", "pull", "Not A Ref")
        assert bad.exit_code != 0 and "invalid registry reference" in bad.output
    finally:
        registry.stop()
