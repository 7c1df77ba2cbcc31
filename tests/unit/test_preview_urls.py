"""Preview URLs: signed tokens, the key file, and the one route that needs no bearer token.

The fake guest's port is a real web service on loopback (see test_ports.py).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkd import limits
from forkd.controller.services import ports as port_service
from forkd.controller.services.preview_tokens import KEY_FILE, PreviewKey, parse
from forkd.controller.settings import Settings
from forkd.errors import Forbidden
from tests.unit import port_fixtures
from tests.unit.conftest import TOKEN, Server

GUEST_PORT = port_fixtures.GUEST_PORT
web, http, sid, _vm = port_fixtures.web, port_fixtures.http, port_fixtures.sid, port_fixtures.vm


@pytest.fixture
def anon(server: Server) -> Iterator[httpx.Client]:
    """A browser: no bearer token."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def _preview(http: httpx.Client, sandbox_id: str, port: int = GUEST_PORT, **body: int) -> dict:
    r = http.post(f"/v1/sandboxes/{sandbox_id}/preview-urls", json={"port": port, **body})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _swap(token: str, field: int, value: str) -> str:
    parts = token.split(".")
    parts[field] = value
    return ".".join(parts)


# -- tokens ---------------------------------------------------------------------------


def test_a_token_verifies_only_for_what_it_was_signed_for(tmp_path: Path) -> None:
    key = PreviewKey(tmp_path)
    token = key.sign("sb-a-0001", 1000, 8000, 2000)
    claim = parse(token)
    assert (claim.sandbox_id, claim.port, claim.expires_at_unix) == ("sb-a-0001", 8000, 2000)
    key.verify(claim, 1000)
    with pytest.raises(Forbidden):
        key.verify(claim, 1001)  # another sandbox that reuses the id
    for field, value in ((1, "sb-a-0002"), (2, "8001"), (3, "2001")):
        with pytest.raises(Forbidden):
            key.verify(parse(_swap(token, field, value)), 1000)
    with pytest.raises(Forbidden):
        PreviewKey(tmp_path / "other").verify(claim, 1000)  # another daemon's key


MAC = "A" * 43


@pytest.mark.parametrize(
    "token",
    [
        "",
        "x",
        "p1.sb.8000.1",
        f"p2.sb.8000.1.{MAC}",
        f"p1.sb.8000.1.{MAC[1:]}",
        f"p1.{'s' * 200}.1.1.{MAC}",
        f"p1.sb/x.8000.1.{MAC}",
        f"p1.sb.8000.1.{MAC}\n",
    ],
)
def test_anything_but_a_well_formed_token_is_refused_before_any_work(token: str) -> None:
    with pytest.raises(Forbidden):
        parse(token)


def test_the_key_is_made_on_first_use_0600_and_deleting_it_rotates_it(tmp_path: Path) -> None:
    key = PreviewKey(tmp_path)
    assert not (tmp_path / KEY_FILE).exists()
    token = key.sign("sb-a-0001", 1, 8000, 2)
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_size == 32
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]  # no partial file left
    assert PreviewKey(tmp_path).sign("sb-a-0001", 1, 8000, 2) == token  # a restart keeps it
    path.unlink()
    with pytest.raises(Forbidden):
        key.verify(parse(token), 1)  # no restart needed
    os.chmod(path, 0o644)
    with pytest.raises(Exception, match="chmod 600"):
        key.sign("sb-a-0001", 1, 8000, 2)


# -- the routes ---------------------------------------------------------------------------


def test_a_preview_url_opens_the_port_without_a_token(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server
) -> None:
    before = time.time()
    info = _preview(http, sid, ttl_s=120)
    assert info["port"] == GUEST_PORT
    assert info["url"] == f"{server.url}/v1/preview/{info['token']}/"
    assert before + 119 <= info["expires_at_unix"] <= time.time() + 121
    assert info["expires_at"].startswith(time.strftime("%Y-", time.gmtime()))
    r = anon.get(info["url"] + "deep/path?x=1")
    assert r.status_code == 200 and r.text == "hello from the fake guest at /deep/path?x=1\n"
    sent = dict(anon.get(info["url"] + "headers", headers={"Authorization": "Basic x"}).json())
    assert "authorization" not in sent
    assert sent["x-forwarded-prefix"] == f"/v1/preview/{info['token']}"


def test_the_default_ttl_is_an_hour_and_ttls_are_bounded(http: httpx.Client, sid: str) -> None:
    assert abs(_preview(http, sid)["expires_at_unix"] - time.time() - 3600) < 5
    for ttl in (0, 7 * 86400 + 1, "60"):
        r = http.post(f"/v1/sandboxes/{sid}/preview-urls", json={"port": 8000, "ttl_s": ttl})
        assert r.status_code == 400, r.text
    for port in (0, 65536, 8888):
        r = http.post(f"/v1/sandboxes/{sid}/preview-urls", json={"port": port})
        assert r.status_code == 400, r.text
    r = http.post("/v1/sandboxes/sb-nope-0001/preview-urls", json={"port": 80})
    assert r.status_code == 404


def test_the_port_url_route_is_the_same_with_the_port_in_the_path(
    http: httpx.Client, anon: httpx.Client, sid: str
) -> None:
    r = http.post(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/url", json={"ttl_s": 60})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["port"] == GUEST_PORT and info["expires_at_unix"] <= time.time() + 61
    assert anon.get(info["url"] + "x").status_code == 200
    assert http.post(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/url").status_code == 201
    for port, body in ((0, {}), (65536, {}), (8888, {}), (GUEST_PORT, {"ttl_s": 0})):
        r = http.post(f"/v1/sandboxes/{sid}/ports/{port}/url", json=body)
        assert r.status_code == 400, (port, r.text)
    # Under the proxy's prefix, but the daemon's route: its body is bounded like any JSON.
    chunks = (b" " * (1 << 20) for _ in range(4))  # chunked: no length to refuse up front
    r = http.post(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/url", content=chunks)
    assert r.status_code == 413, r.text


def _other_last(token: str) -> str:
    """The token with its last MAC character changed in its data bits (the last of 43
    base64 characters carries 4 bits; "A" and "Q" differ in them)."""
    return token[:-1] + ("Q" if token[-1] == "A" else "A")


def test_a_tampered_token_is_refused_and_never_reaches_a_guest(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server, web: int
) -> None:
    other = str(http.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"])
    _vm(server, other).ports[GUEST_PORT] = web
    _vm(server, sid).ports[8001] = web
    token = _preview(http, sid)["token"]
    for forged in (
        _swap(token, 2, "8001"),
        _swap(token, 1, other),
        _swap(token, 3, str(int(time.time()) + 10**6)),
        _other_last(token),
        "x" * 5000,
    ):
        r = anon.get(f"/v1/preview/{forged}/")
        assert r.status_code == 403, (forged, r.text)
        assert "hello" not in r.text


def test_an_expired_preview_url_is_a_403(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server, settings: Settings
) -> None:
    url = _preview(http, sid, ttl_s=60)["url"]
    assert anon.get(url).status_code == 200
    # The same sandbox and port, signed by the daemon's key, a second in the past (a
    # loaded host may take longer than a 1 s TTL between making a URL and using it).
    created = http.get(f"/v1/sandboxes/{sid}").json()["created_at_unix"]
    token = PreviewKey(settings.state_dir).sign(sid, created, GUEST_PORT, int(time.time()) - 1)
    r = anon.get(f"{server.url}/v1/preview/{token}/")
    assert r.status_code == 403 and "expired" in r.json()["error"]


def test_a_preview_url_of_a_killed_sandbox_stops_working(
    http: httpx.Client, anon: httpx.Client, sid: str
) -> None:
    url = _preview(http, sid)["url"]
    assert http.delete(f"/v1/sandboxes/{sid}").status_code == 204
    assert anon.get(url).status_code in (403, 404)


def test_a_paused_sandboxs_preview_wakes_it_unless_made_without_auto_resume(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server, web: int
) -> None:
    url = _preview(http, sid)["url"]
    assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    r = anon.get(url)
    assert r.status_code == 200 and "forkd-wake-ms" in r.headers
    made = http.post("/v1/sandboxes", json={"snapshot_tag": "py", "auto_resume": False}).json()
    other = made[0]["id"]
    port_fixtures.vm(server, other).ports[GUEST_PORT] = web
    url = _preview(http, other)["url"]
    assert http.post(f"/v1/sandboxes/{other}/pause").status_code == 200
    assert anon.get(url).status_code == 409


def test_only_the_preview_route_is_open_without_the_bearer(
    anon: httpx.Client, http: httpx.Client, sid: str
) -> None:
    token = _preview(http, sid)["token"]
    for path in (
        f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/",
        f"/v1/preview/{token}",
        f"/v1/preview/{token}/../../sandboxes/{sid}",
        "/v1/preview/",
        f"/v1/sandboxes/{sid}/preview-urls",
    ):
        assert anon.get(path).status_code in (401, 403, 404), path
    r = anon.post(f"/v1/sandboxes/{sid}/preview-urls", json={"port": GUEST_PORT})
    assert r.status_code == 401
    # A path that climbs out of the prefix stays the guest's: it never meets a daemon route.
    r = anon.get(f"/v1/preview/{token}/..%2F..%2Fsandboxes")
    assert r.status_code == 200 and r.text.startswith("hello from the fake guest at /")


def test_the_audit_log_never_records_a_preview_token(
    http: httpx.Client, anon: httpx.Client, sid: str, settings: Settings
) -> None:
    token = _preview(http, sid)["token"]
    assert anon.get(f"/v1/preview/{token}/x").status_code == 200
    record = port_fixtures.last_audit_record(settings.state_dir, "GET")
    assert record["path"] == "/v1/preview/<token>/x"
    log = (settings.state_dir / "audit.log").read_text()
    assert token not in log and token.split(".")[-1] not in log
    assert TOKEN not in log


def test_preview_holders_take_only_a_share_of_the_sandbox_s_connections(
    http: httpx.Client, anon: httpx.Client, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone with a preview URL can open connections: they may not take the ones the
    sandbox's owner needs (a slow upload held open would otherwise shut the owner out)."""
    monkeypatch.setattr(port_service, "PREVIEW_CONNECTIONS_PER_SANDBOX", 1)
    url = _preview(http, sid)["url"]
    with anon.stream("GET", url + "drip?n=400") as held:  # 20 s of it
        assert held.status_code == 200
        refused = anon.get(url)
        assert refused.status_code == 503 and "kept for its owner" in refused.json()["error"]
        owner = http.get(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/")
        assert owner.status_code == 200


def test_the_daemon_s_proxied_connections_are_sized_by_its_open_file_limit() -> None:
    assert limits.default_max_proxied(400) == 100  # a quarter: the guest sockets they hold
    assert limits.default_max_proxied(1 << 20) == limits.MAX_CONNECTIONS
    assert port_service.proxied_cap() <= limits.default_max_proxied()


def test_preview_holders_take_only_a_share_of_the_daemon_s_connections(
    http: httpx.Client, anon: httpx.Client, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(port_service, "MAX_CONNECTIONS", 2)  # previews may hold 1 of them
    url = _preview(http, sid)["url"]
    with anon.stream("GET", url + "drip?n=400") as held:  # 20 s of it
        assert held.status_code == 200
        refused = anon.get(url)
        assert refused.status_code == 503 and "sandboxes' owners" in refused.json()["error"]
        assert http.get(f"/v1/sandboxes/{sid}/ports/{GUEST_PORT}/").status_code == 200
