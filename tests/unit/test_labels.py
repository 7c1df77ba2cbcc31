"""Labels (``metadata``) on snapshots and sandboxes, and the list filters, over the real
app with a fake VM driver; the SDK and CLI verbs; the store's migration."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller, ControllerError, Sandbox
from forkd.controller.store import Store
from tests.unit.conftest import Invoke, RecordingTransport, Server


@pytest.fixture
def ctl(server: Server, sent: RecordingTransport) -> Iterator[Controller]:
    with Controller(server.url, token=server.token, transport=sent) as c:
        yield c


def _ids(infos: list[dict[str, Any]]) -> set[str]:
    return {i["id"] for i in infos}


def test_children_inherit_the_snapshots_labels_and_override_them(ctl: Controller) -> None:
    snap = ctl.create_snapshot("py", memory_mib=128, metadata={"team": "a", "run": "1"})
    assert snap["metadata"] == {"team": "a", "run": "1"}
    plain = ctl.spawn_sandboxes("py")[0]
    assert plain["metadata"] == {"team": "a", "run": "1"}
    kid = ctl.spawn_sandboxes("py", metadata={"run": "42", "who": "me"})[0]
    assert kid["metadata"] == {"team": "a", "run": "42", "who": "me"}
    branch = ctl.branch_sandbox(kid["id"], tag="b1", metadata={"step": "3"})
    assert branch["metadata"] == {"team": "a", "run": "42", "who": "me", "step": "3"}
    assert ctl.snapshot_info("b1")["metadata"] == branch["metadata"]


def test_each_filter_returns_exactly_the_matching_set(ctl: Controller) -> None:
    ctl.create_snapshot("py", memory_mib=128, metadata={"kind": "tpl"})
    ctl.create_snapshot("other", memory_mib=128)
    a, b = (s["id"] for s in ctl.spawn_sandboxes("py", n=2, metadata={"run": "42"}))
    c = ctl.spawn_sandboxes("py", metadata={"run": "7"})[0]["id"]
    d = ctl.spawn_sandboxes("other", metadata={"run": "42"})[0]["id"]
    ctl.pause_sandbox(b)
    assert _ids(ctl.list_sandboxes(metadata={"run": "42"})) == {a, b, d}
    assert _ids(ctl.list_sandboxes(metadata={"run": "42", "kind": "tpl"})) == {a, b}
    assert _ids(ctl.list_sandboxes(state="paused")) == {b}
    assert _ids(ctl.list_sandboxes(state="running", metadata={"run": "42"})) == {a, d}
    assert _ids(ctl.list_sandboxes(snapshot="other")) == {d}
    assert _ids(ctl.list_sandboxes(metadata={"run": "nope"})) == set()
    assert _ids(ctl.list_sandboxes()) == {a, b, c, d}
    assert [s["tag"] for s in ctl.list_snapshots(metadata={"kind": "tpl"})] == ["py"]
    assert {s["tag"] for s in ctl.list_snapshots()} == {"py", "other"}


@pytest.mark.parametrize(
    "metadata",
    [
        {"bad key": "v"},
        {"": "v"},
        {"k": "x" * 257},
        {"k": 1},
        {f"k{i}": "v" for i in range(65)},
    ],
)
def test_bad_labels_are_a_400_and_fork_nothing(ctl: Controller, metadata: Any) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("py", metadata=metadata)
    assert exc.value.status == 400
    assert ctl.list_sandboxes() == []
    with pytest.raises(ControllerError) as exc:
        ctl.create_snapshot("py2", memory_mib=128, metadata=metadata)
    assert exc.value.status == 400 and [s["tag"] for s in ctl.list_snapshots()] == ["py"]


def test_an_unknown_state_filter_is_a_400(ctl: Controller) -> None:
    with pytest.raises(ControllerError) as exc:
        ctl.list_sandboxes(state="sleeping")
    assert exc.value.status == 400 and "sleeping" in exc.value.message


def test_sdk_sandbox_list(ctl: Controller) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    mine = Sandbox("py", controller=ctl, metadata={"run": "42"})
    Sandbox("py", controller=ctl)
    found = Sandbox.list(metadata={"run": "42"}, state="running", controller=ctl)
    assert [sb.id for sb in found] == [mine.id] and found[0].metadata == {"run": "42"}


def test_cli_labels_and_filters(forkd: Invoke, ctl: Controller) -> None:
    ctl.create_snapshot("py", memory_mib=128)
    r = forkd("fork", "--tag", "py", "--label", "run=42", "--label", "who=me", "--json")
    assert r.exit_code == 0, r.output
    sid = json.loads(r.stdout)[0]["id"]
    assert ctl.get_sandbox(sid)["metadata"] == {"run": "42", "who": "me"}
    ctl.spawn_sandboxes("py")
    r = forkd("ps", "--filter", "run=42", "--json")
    assert [s["id"] for s in json.loads(r.stdout)] == [sid]
    r = forkd("ps", "--filter", "run", "--json")
    assert r.exit_code == 2 and "KEY=VALUE" in r.output


def test_an_older_database_gains_the_label_columns(tmp_path: Path) -> None:
    path = tmp_path / "forkd.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE snapshots (tag TEXT PRIMARY KEY, dir TEXT NOT NULL, created_at_unix "
        "INTEGER NOT NULL, branched_from TEXT, pause_ms REAL, parent_tag TEXT, image TEXT, "
        "memory_mib INTEGER NOT NULL, status TEXT NOT NULL DEFAULT 'ready');"
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, snapshot_tag TEXT NOT NULL, run_dir TEXT "
        "NOT NULL, pid INTEGER, created_at_unix INTEGER NOT NULL, memory_limit_mib INTEGER, "
        "expires_at_unix REAL, state TEXT NOT NULL);"
        "INSERT INTO snapshots VALUES ('old', '/x', 1, NULL, NULL, NULL, NULL, 128, 'ready');"
        "INSERT INTO sandboxes VALUES ('sb-1', 'old', '/r', NULL, 1, NULL, NULL, 'running');"
    )
    db.close()
    store = Store(path)
    assert store.get_snapshot("old").metadata == {}  # type: ignore[union-attr]
    sandbox = store.get_sandbox("sb-1")
    assert sandbox is not None and sandbox.metadata == {} and sandbox.fork_ms is None


@pytest.mark.parametrize(
    "query",
    ["metdata.run=42", "state=running&state=dead", "metadata.run=1&metadata.run=2", "metadata.=x"],
)
def test_a_filter_that_would_be_ignored_is_a_400(
    server: Server, ctl: Controller, query: str
) -> None:
    import httpx

    ctl.create_snapshot("py", memory_mib=128)
    ctl.spawn_sandboxes("py")
    auth = {"Authorization": f"Bearer {server.token}"}
    for route in ("/v1/sandboxes", "/v1/snapshots"):
        r = httpx.get(f"{server.url}{route}?{query}", headers=auth)
        assert r.status_code == 400, (route, query, r.text)


def test_labels_past_the_cap_with_those_inherited_are_a_400(ctl: Controller) -> None:
    ctl.create_snapshot("py", memory_mib=128, metadata={f"a{i}": "v" for i in range(40)})
    with pytest.raises(ControllerError) as exc:
        ctl.spawn_sandboxes("py", metadata={f"b{i}": "v" for i in range(30)})
    assert exc.value.status == 400 and "inherited" in exc.value.message
    assert ctl.list_sandboxes() == []
