"""The port proxy (``/v1/sandboxes/{id}/ports/{port}/...``) over the fake driver.

The fake guest's port is a real web service on loopback
(tests/integration/guest_web.py, the one the integration tests run in a
guest), and the app runs under a real uvicorn, so framing, streaming and
headers are those of real sockets.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from forkd.controller.services import ports as port_service
from forkd.controller.services.preview_tokens import PreviewKey
from forkd.controller.settings import Settings
from tests.unit import port_fixtures
from tests.unit.conftest import Server

GUEST_PORT = port_fixtures.GUEST_PORT
last_audit_record = port_fixtures.last_audit_record
web, http, sid, _vm = port_fixtures.web, port_fixtures.http, port_fixtures.sid, port_fixtures.vm


def _url(sandbox_id: str, path: str = "/", port: int = GUEST_PORT) -> str:
    return f"/v1/sandboxes/{sandbox_id}/ports/{port}{path}"


# -- the proxy --------------------------------------------------------------------


def test_a_guest_port_answers_through_the_proxy_with_its_path_and_query(
    http: httpx.Client, sid: str
) -> None:
    r = http.get(_url(sid, "/some/where?q=1&r=%2F"))
    assert r.status_code == 200
    assert r.text == "hello from the fake guest at /some/where?q=1&r=%2F\n"


def test_hop_by_hop_headers_are_dropped_both_ways_and_the_token_never_reaches_the_guest(
    http: httpx.Client, sid: str
) -> None:
    r = http.get(
        _url(sid, "/headers"),
        headers={
            "X-Forwarded-Host": "evil.example",
            "Forwarded": "for=6.6.6.6",
            "Connection": "X-Secret",
            "X-Secret": "not for the guest",
            "Keep-Alive": "timeout=1",
            "X-Kept": "yes",
        },
    )
    sent = dict(r.json())
    assert "authorization" not in sent and "forwarded" not in sent
    assert "x-secret" not in sent and "keep-alive" not in sent
    assert sent["x-kept"] == "yes"
    assert sent["x-forwarded-for"] == "127.0.0.1"
    assert sent["x-forwarded-host"] == http.base_url.netloc.decode()
    assert sent["x-forwarded-proto"] == "http"
    assert sent["x-forwarded-prefix"] == f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}"
    assert sent["host"] == f"localhost:{GUEST_PORT}"
    answer = http.get(_url(sid, "/"))
    assert "x-private" not in answer.headers and "keep-alive" not in answer.headers
    # A guest's page may not act on the daemon's whole origin (all previews share it).
    assert "service-worker-allowed" not in answer.headers
    assert "clear-site-data" not in answer.headers


def cookie_tag(settings: Settings, prefix: str) -> str:
    """The tag the daemon names a guest's cookies with (keyed by its preview key)."""
    return PreviewKey(settings.state_dir).cookie_tag(prefix).decode()


def test_a_guest_s_cookies_stay_under_its_prefix_and_it_cannot_join_the_console_s_window(
    http: httpx.Client, sid: str, settings: Settings
) -> None:
    """The guest's pages share the daemon's origin: a cookie it sets must not reach the
    API, the console or another sandbox (its Path and Domain are replaced), and its
    Cross-Origin-Opener-Policy, equal to the console's, would let a console window its
    page opens stay reachable from that page."""
    r = http.get(_url(sid, "/cookies"))
    prefix = f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/"
    tag = cookie_tag(settings, prefix.rstrip("/"))  # the names are the guest's own too
    assert r.headers.get_list("set-cookie") == [
        f"{tag}session=abc; HttpOnly; Path={prefix}",
        f"{tag}theme=dark; Max-Age=60; SameSite=Lax; Path={prefix}",
    ]
    assert "cross-origin-opener-policy" not in r.headers
    for policy in ("nel", "report-to", "alt-svc", "strict-transport-security"):
        assert policy not in r.headers  # each would act on the daemon's whole origin


def test_a_guest_gets_only_its_own_cookies_and_no_referer_and_its_pages_send_none(
    http: httpx.Client, sid: str, settings: Settings
) -> None:
    """Issue 35: on the daemon's origin a page of sandbox A could set a cookie for the
    whole origin (``document.cookie='tossed=fromA; path=/'``) that sandbox B's guest then
    received, and a page of B learnt the URL (its preview token) of the page that led to
    it from Referer."""
    prefix = f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}"
    tag, other = cookie_tag(settings, prefix), cookie_tag(settings, "/v1/preview/another")
    # Keyed: knowing a sandbox's id (its route's prefix) is not knowing its tag.
    elsewhere = settings.state_dir.parent / "elsewhere"
    elsewhere.mkdir()
    assert PreviewKey(elsewhere).cookie_tag(prefix).decode() != tag
    r = http.get(
        _url(sid, "/headers"),
        headers={
            "Cookie": f"tossed=fromA; {tag}session=abc; {other}theirs=x; {tag}theme=dark",
            "Referer": "http://127.0.0.1/v1/preview/another-sandboxes-token/page",
        },
    )
    sent = dict(r.json())
    assert sent["cookie"] == "session=abc; theme=dark"
    assert "referer" not in sent
    assert r.headers["referrer-policy"] == "no-referrer"
    alone = dict(http.get(_url(sid, "/headers"), headers={"Cookie": "tossed=fromA"}).json())
    assert "cookie" not in alone


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_body_streams_to_the_guest_and_its_answer_back(
    http: httpx.Client, sid: str, chunked: bool
) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB
    if chunked:
        content: Any = (payload[i : i + 65536] for i in range(0, len(payload), 65536))
    else:
        content = payload
    r = http.post(_url(sid, "/echo"), content=content)
    assert r.status_code == 200
    assert r.headers["x-received"] == str(len(payload))
    assert r.content == payload


def test_a_chunked_answer_streams_as_the_guest_writes_it(http: httpx.Client, sid: str) -> None:
    arrivals = []
    with http.stream("GET", _url(sid, "/drip?n=10")) as r:
        for line in r.iter_lines():
            arrivals.append((time.monotonic(), line))
    assert [line for _, line in arrivals] == [f"line {i}" for i in range(10)]
    assert arrivals[-1][0] - arrivals[0][0] > 0.2  # pieces came as written, not at the end


def test_a_head_request_gets_the_head_only(http: httpx.Client, sid: str) -> None:
    r = http.head(_url(sid, "/"))
    assert r.status_code == 200 and r.content == b""
    assert int(r.headers["content-length"]) > 0


def test_a_port_nothing_listens_on_is_a_502_that_says_so(http: httpx.Client, sid: str) -> None:
    r = http.get(_url(sid, "/", port=8001))
    assert r.status_code == 502
    assert "nothing listens on port 8001" in r.json()["error"]


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http", "8888"])
def test_a_port_outside_the_range_or_the_agents_is_a_400(
    http: httpx.Client, sid: str, port: str
) -> None:
    r = http.get(f"/v1/sandboxes/{sid}/ports/{port}/")
    assert r.status_code == 400, r.text
    if port == "8888":
        assert "agent" in r.json()["error"]


def test_a_paused_sandbox_is_woken_and_an_unknown_one_a_404(http: httpx.Client, sid: str) -> None:
    assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    r = http.get(_url(sid))
    assert r.status_code == 200 and "forkd-wake-ms" in r.headers  # tests/unit/test_waking.py
    assert http.get(_url("sb-nope-0001")).status_code == 404


def test_the_proxy_needs_the_bearer_token(server: Server, sid: str) -> None:
    r = httpx.get(server.url + _url(sid), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_a_guest_that_never_answers_is_a_502_within_the_head_bound(
    http: httpx.Client, server: Server, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from forkd import limits

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    _vm(server, sid).ports[8002] = silent.getsockname()[1]
    monkeypatch.setattr(limits, "PORT_HEAD_SECS", 0.5)
    started = time.monotonic()
    r = http.get(_url(sid, port=8002))
    silent.close()
    assert r.status_code == 502 and "no answer within" in r.json()["error"]
    assert time.monotonic() - started < 5


def test_a_stream_ends_when_its_sandbox_is_killed(
    http: httpx.Client, server: Server, sid: str
) -> None:
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def answer_head_then_hang() -> None:
        conn, _ = silent.accept()
        accepted.append(conn)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhi\n\r\n")

    threading.Thread(target=answer_head_then_hang, daemon=True).start()
    _vm(server, sid).ports[8003] = silent.getsockname()[1]
    with http.stream("GET", _url(sid, port=8003)) as r:
        assert r.status_code == 200
        pieces = r.iter_raw()
        assert next(pieces) == b"hi\n"
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
        started = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # cut short: never taken for a whole body
            for _ in pieces:
                pass
        assert time.monotonic() - started < 5
    silent.close()
    for conn in accepted:
        conn.close()


def test_each_sandbox_has_a_cap_on_proxied_connections(
    http: httpx.Client, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(port_service, "MAX_CONNECTIONS_PER_SANDBOX", 1)
    with http.stream("GET", _url(sid, "/drip?n=20")) as first:
        assert first.status_code == 200
        second = http.get(_url(sid))
        assert second.status_code == 503 and "proxied connections" in second.json()["error"]
        first.read()
    deadline = time.monotonic() + 5  # the slot is given back once the server's side ended
    while http.get(_url(sid)).status_code != 200:
        assert time.monotonic() < deadline, "the connection slot was never given back"
        time.sleep(0.05)


def test_the_daemon_has_a_cap_on_proxied_connections_of_all_sandboxes(
    http: httpx.Client, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(port_service, "MAX_CONNECTIONS", 1)
    with http.stream("GET", _url(sid, "/drip?n=20")) as first:
        assert first.status_code == 200
        other = http.get(_url(sid))  # under the sandbox's cap, over the daemon's
        assert other.status_code == 503 and "the most it keeps" in other.json()["error"]
        first.read()


def test_the_audit_log_records_proxied_requests(
    http: httpx.Client, server: Server, sid: str, settings: Any
) -> None:
    assert http.get(_url(sid, "/x")).status_code == 200
    record = last_audit_record(settings.state_dir, "GET")
    assert record["path"] == _url(sid, "/x") and record["status"] == 200
    assert record["sandbox_id"] == sid
