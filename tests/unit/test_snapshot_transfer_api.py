"""The push and pull routes over the real app (fake VM driver): bad input is a clear 4xx
before any registry is asked, and a snapshot being pushed cannot be deleted."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient


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
