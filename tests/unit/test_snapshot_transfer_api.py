"""The push and pull routes over the real app (fake VM driver): bad input is a clear 4xx
before any registry is asked, and a snapshot being pushed cannot be deleted."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd.controller.models import SnapshotPull, SnapshotPush
from forkd.errors import UpstreamError


@pytest.fixture
def base(client: TestClient) -> str:
    r = client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
    assert r.status_code == 201, r.text
    return "base"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"ref": "Not A Ref"}, 400, "invalid registry reference"),
        ({"ref": "127.0.0.1:5000/a@sha256:" + "a" * 64}, 400, "not to a digest"),
        ({"ref": "127.0.0.1:5000/a:b", "flatten": "yes"}, 400, "flatten"),
        ({}, 400, "ref"),
    ],
)
def test_bad_push_requests(client: TestClient, base: str, body: Any, status: int, words: str):
    r = client.post(f"/v1/snapshots/{base}/push", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_push_of_an_unknown_snapshot_is_404(client: TestClient) -> None:
    r = client.post("/v1/snapshots/nope/push", json={"ref": "127.0.0.1:1/a:b"})
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"ref": "a b"}, "invalid registry reference"),
        ({"ref": "127.0.0.1:5000/a:b", "tag": "../etc"}, "tag"),
        ({"ref": "127.0.0.1:5000/a:b", "token": 5}, "token"),
    ],
)
def test_bad_pull_requests(client: TestClient, body: Any, words: str) -> None:
    r = client.post("/v1/snapshots/pull", json=body)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_a_pull_into_a_taken_tag_is_409_before_the_registry(client: TestClient, base: str) -> None:
    r = client.post("/v1/snapshots/pull", json={"ref": "127.0.0.1:1/a:b", "tag": base})
    assert r.status_code == 409 and "already exists" in r.json()["error"]
    r = client.post("/v1/snapshots/pull", json={"ref": "127.0.0.1:1/a:b"})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]


def test_a_snapshot_being_pushed_cannot_be_deleted(client: TestClient, base: str) -> None:
    snaps = client.app.state.services.snapshots  # type: ignore[attr-defined]
    with snaps.reading(base):
        r = client.delete(f"/v1/snapshots/{base}")
        assert r.status_code == 409 and "being pushed" in r.json()["error"]
    assert not snaps.being_read
    assert client.delete(f"/v1/snapshots/{base}").status_code == 204


def _give_up_once_started(
    client: TestClient, start: Callable[[], Awaitable[Any]], started: threading.Event
) -> None:
    """Run ``start()`` on the app's loop and cancel it once its thread has started,
    as a client that goes away does."""

    async def give_up() -> None:
        task = asyncio.ensure_future(start())
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    client.portal.call(give_up)  # type: ignore[attr-defined]


def _wait_until(client: TestClient, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        client.portal.call(asyncio.sleep, 0.02)  # type: ignore[attr-defined]


def test_a_push_whose_request_goes_away_holds_the_snapshot_until_its_thread_ends(
    client: TestClient, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The push thread cannot be stopped; it reads the snapshot's files to its end.
    # So the hold against deletion, and its place under the transfers cap, last as
    # long as the thread, not as long as the request that started it.
    services = client.app.state.services  # type: ignore[attr-defined]
    transfer, snaps = services.transfer, services.snapshots
    started, finish = threading.Event(), threading.Event()

    def slow_push(registry: Any, *args: Any) -> Any:
        started.set()
        finish.wait(10)
        raise UpstreamError("the registry went away")

    monkeypatch.setattr(transfer, "_push_one", slow_push)

    req = SnapshotPush(ref="127.0.0.1:1/forkd/x:v1")
    _give_up_once_started(client, lambda: transfer.push(base, req), started)
    assert snaps.being_read[base] == 1 and transfer._running == 1  # the thread still reads
    r = client.delete(f"/v1/snapshots/{base}")
    assert r.status_code == 409 and "being pushed" in r.json()["error"]
    finish.set()
    _wait_until(client, lambda: not (snaps.being_read or transfer._running))
    assert not snaps.being_read and transfer._running == 0
    assert client.delete(f"/v1/snapshots/{base}").status_code == 204


def test_a_pull_whose_request_goes_away_keeps_its_tag_until_its_thread_ends(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread writing a pulled snapshot goes on after its request is gone: the tag
    # stays reserved (no second pull or create may take it meanwhile) until it ends.
    from forkd.controller.services import snapshot_transfer

    services = client.app.state.services  # type: ignore[attr-defined]
    transfer, fleet = services.transfer, services.fleet
    started, finish = threading.Event(), threading.Event()

    class Remote:
        config: dict[str, Any] = {}

    def slow_write(*args: Any) -> Any:
        started.set()
        finish.wait(10)
        raise UpstreamError("the registry went away")

    monkeypatch.setattr(snapshot_transfer.pull, "open_remote", lambda *a: Remote())
    monkeypatch.setattr(transfer, "_check", lambda remote: None)
    monkeypatch.setattr(transfer, "_pull_sync", slow_write)

    req = SnapshotPull(ref="127.0.0.1:1/forkd/x:v1", tag="pulled")
    _give_up_once_started(client, lambda: transfer.pull(req), started)
    assert "pulled" in fleet._tags_in_flight and transfer._running == 1
    r = client.post("/v1/snapshots", json={"tag": "pulled", "memory_mib": 128})
    assert r.status_code == 409 and "being created" in r.json()["error"]
    finish.set()
    _wait_until(client, lambda: not (fleet._tags_in_flight or transfer._running))
    assert not fleet._tags_in_flight and transfer._running == 0
