"""Wake on demand over the real app and a fake VM driver: a request to a paused or
hibernated sandbox resumes it first and is answered, saying what the wake cost; many
requests share one wake, and a failed wake is each one's failure; a sandbox made with
``auto_resume: false`` is a 409 as before; a followed output stream does not wake."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forkd.controller.services import processes as process_service
from forkd.errors import VMError
from tests.unit import port_fixtures
from tests.unit.conftest import TOKEN, Server

GUEST_PORT = port_fixtures.GUEST_PORT
web, http, sid, _vm = port_fixtures.web, port_fixtures.http, port_fixtures.sid, port_fixtures.vm
WAKE = "forkd-wake-ms"


def _exec(http: httpx.Client, sandbox_id: str) -> httpx.Response:
    return http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"args": ["echo", "hi"]})


def _together(server: Server, sandbox_id: str, n: int) -> list[httpx.Response]:
    """``n`` execs sent at once, each on a connection of its own."""
    answers: list[httpx.Response] = []

    def one() -> None:
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        ) as c:
            answers.append(_exec(c, sandbox_id))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


def _state(http: httpx.Client, sandbox_id: str) -> str:
    return str(http.get(f"/v1/sandboxes/{sandbox_id}").json()["state"])


def _events(http: httpx.Client, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` events kept so far (the stream is read until it falls quiet)."""
    found: list[dict[str, Any]] = []
    try:
        with http.stream(
            "GET",
            "/v1/events",
            params={"type": kind, "since": 0},
            timeout=httpx.Timeout(10, read=1),
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    found.append(json.loads(line[5:]))
    except httpx.ReadTimeout:
        pass
    return found


@pytest.mark.parametrize("how", ["pause", "hibernate"])
def test_an_exec_wakes_a_sleeping_sandbox_and_says_what_it_cost(
    http: httpx.Client, sid: str, how: str
) -> None:
    body = {"hibernate": True} if how == "hibernate" else {}
    assert http.post(f"/v1/sandboxes/{sid}/pause", json=body).status_code == 200
    slept = "hibernated" if how == "hibernate" else "paused"
    assert _state(http, sid) == slept
    r = _exec(http, sid)
    assert r.status_code == 200, r.text
    assert r.json()["stdout"] == "hi\n"
    assert float(r.headers[WAKE]) >= 0
    assert _state(http, sid) == "running"
    again = _exec(http, sid)  # running now: no wake, no header
    assert again.status_code == 200 and WAKE not in again.headers
    metrics = http.get("/metrics").text
    assert f'forkd_wakes_total{{from="{slept}"}} 1' in metrics
    assert "forkd_wake_seconds_count 1" in metrics


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/files", {"path": "/etc/hostname"}),
        ("GET", "/files/list", {"path": "/"}),
        ("GET", "/processes", None),
        ("POST", "/eval", {"code": "1 + 1"}),
        ("GET", "/diff", {"path": "/work"}),
    ],
)
def test_each_kind_of_guest_request_wakes_it(
    http: httpx.Client, sid: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    assert http.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
    kw: dict[str, Any] = {"json": body} if method == "POST" else {"params": body or {}}
    r = http.request(method, f"/v1/sandboxes/{sid}{path}", **kw)
    assert r.status_code != 409, r.text
    assert WAKE in r.headers and _state(http, sid) == "running"


def test_the_port_proxy_wakes_a_paused_sandbox(http: httpx.Client, sid: str) -> None:
    assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    r = http.get(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/")
    assert r.status_code == 200 and WAKE in r.headers
    assert _state(http, sid) == "running"


def test_many_requests_share_one_wake(http: httpx.Client, server: Server, sid: str) -> None:
    assert http.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
    restores = len(server.driver.restore_kwargs)
    server.driver.restore_delay = 0.5  # the wake is slow: every request comes meanwhile
    answers = _together(server, sid, 5)
    assert [a.status_code for a in answers] == [200] * 5
    assert len(server.driver.restore_kwargs) == restores + 1  # one wake for all five
    assert all(float(a.headers[WAKE]) >= 400 for a in answers)
    woke = [e for e in _events(http, "resumed") if e.get("reason") == "request"]
    assert len(woke) == 1 and woke[0]["woken"] is True and woke[0]["wake_ms"] >= 400


def test_a_failed_wake_fails_every_request_that_waited_with_the_same_error(
    http: httpx.Client, server: Server, sid: str
) -> None:
    assert http.post(f"/v1/sandboxes/{sid}/pause", json={"hibernate": True}).status_code == 200
    server.driver.restore_delay = 0.5
    server.driver.fail_restore = VMError("QEMU would not start")
    answers = _together(server, sid, 3)
    assert {a.status_code for a in answers} == {500}
    assert len({a.json()["error"] for a in answers}) == 1
    assert "QEMU would not start" in answers[0].json()["error"]
    assert _state(http, sid) == "hibernated"  # as it was
    said = [e for e in server.app.state.services.events.held(sid) if e["type"] == "wake_failed"]
    assert len(said) == 1  # one wake failed, however many waited for it
    assert (
        said[0]["reason"].startswith("wake_failed: ")
        and "QEMU would not start" in said[0]["reason"]
    )
    server.driver.fail_restore = None
    assert _exec(http, sid).status_code == 200  # the next request wakes it


@pytest.fixture
def no_wake(http: httpx.Client, sid: str) -> Iterator[str]:
    """A sandbox made with auto_resume false."""
    r = http.post("/v1/sandboxes", json={"snapshot_tag": "py", "auto_resume": False})
    assert r.status_code == 201 and r.json()[0]["auto_resume"] is False
    yield str(r.json()[0]["id"])


@pytest.mark.parametrize("how", ["pause", "hibernate"])
def test_a_sandbox_made_without_auto_resume_is_a_409_until_resumed(
    http: httpx.Client, no_wake: str, how: str
) -> None:
    body = {"hibernate": True} if how == "hibernate" else {}
    assert http.post(f"/v1/sandboxes/{no_wake}/pause", json=body).status_code == 200
    r = _exec(http, no_wake)
    assert r.status_code == 409 and "resume it first" in r.json()["error"]
    assert WAKE not in r.headers and _state(http, no_wake) != "running"
    assert http.post(f"/v1/sandboxes/{no_wake}/resume").status_code == 200
    assert _exec(http, no_wake).status_code == 200


def test_a_followed_output_stream_open_across_a_pause_does_not_wake_it(
    http: httpx.Client, server: Server, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process_service, "FOLLOW_WAIT_SECS", 0.2)  # it reads again and again
    r = http.post(f"/v1/sandboxes/{sid}/processes", json={"cmd": ["sleep", "30"]})
    assert r.status_code == 201, r.text
    pid = r.json()["pid"]
    following, paused = threading.Event(), threading.Event()

    def follow() -> None:
        url = f"{server.url}/v1/sandboxes/{sid}/processes/{pid}/output"
        with httpx.stream(
            "GET",
            url,
            params={"follow": "true"},
            timeout=10,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as out:
            following.set()
            read_on = None
            for _ in out.iter_lines():  # keep-alives, five a second
                if paused.is_set():
                    read_on = read_on or time.monotonic() + 2
                    if time.monotonic() > read_on:
                        return

    follower = threading.Thread(target=follow)
    follower.start()
    assert following.wait(10)
    assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    paused.set()
    follower.join(10)
    assert not follower.is_alive()
    assert _state(http, sid) == "paused"  # the stream read on for seconds: still asleep
