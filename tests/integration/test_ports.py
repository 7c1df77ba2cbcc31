"""Guest ports through a real daemon: the proxy, get_url, WebSockets, preview URLs in
headless Chromium, and ``forkd port-forward`` with curl.

Two children of the ``py`` template run tests/integration/guest_web.py on the
same guest port, each saying its own name; the module shares them (the last
test kills one). Chromium is Debian's (/usr/bin/chromium), driven by
Playwright's Python package; Playwright's own browsers are never downloaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import wsproto.events

from forkd.client import Controller, Sandbox

from .conftest import Daemon, Fleet

pytestmark = pytest.mark.integration

PORT = 8000
CHROMIUM = "/usr/bin/chromium"
GUEST_WEB = Path(__file__).with_name("guest_web.py")


def _serve(sb: Sandbox, name: str) -> None:
    sb.files.write("/tmp/guest_web.py", GUEST_WEB.read_bytes())
    sb.commands.run(["python3", "/tmp/guest_web.py", str(PORT), name], background=True)
    deadline = time.monotonic() + 60
    while True:  # until it listens
        try:
            r = sb.controller._client.get(sb.get_url(PORT, "/"), timeout=10)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"guest_web.py never answered in {sb.id}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def pair(ctl: Controller, api_template: str) -> Iterator[tuple[Sandbox, Sandbox]]:
    """Two children of one snapshot, both serving on guest port 8000: "alpha" and "beta"."""
    a = Sandbox(api_template, controller=ctl)
    b = Sandbox(api_template, controller=ctl)
    try:
        _serve(a, "alpha")
        _serve(b, "beta")
        yield a, b
    finally:
        a.kill()
        b.kill()


def test_the_proxy_and_get_url_reach_each_childs_own_service(
    pair: tuple[Sandbox, Sandbox], daemon: Daemon
) -> None:
    a, b = pair
    auth = {"Authorization": f"Bearer {daemon.token}"}
    for sb, name in ((a, "alpha"), (b, "beta")):
        r = httpx.get(f"{daemon.url}/v1/sandboxes/{sb.id}/ports/{PORT}/x?y=1", headers=auth)
        assert r.status_code == 200 and r.text == f"hello from {name} at /x?y=1\n"
        assert sb.controller._client.get(sb.get_url(PORT, "/")).text.startswith(
            f"hello from {name}"
        )
    assert httpx.get(a.get_url(PORT)).status_code == 401  # no token
    payload = bytes(range(256)) * 4096  # 1 MiB up and back
    r = a.controller._client.post(a.get_url(PORT, "/echo"), content=payload)
    assert r.status_code == 200 and r.content == payload
    r = a.controller._client.get(a.get_url(8001))
    assert r.status_code == 502 and "nothing listens on port 8001" in r.json()["error"]
    assert a.controller._client.get(a.get_url(8888)).status_code == 400


def test_a_websocket_echoes_through_the_proxy(pair: tuple[Sandbox, Sandbox]) -> None:
    a, _ = pair
    with a.websocket(PORT, "/ws") as ws:
        ws.send_text("through the daemon")
        event = ws.receive(timeout=30)
        assert isinstance(event, wsproto.events.TextMessage)
        assert event.data == "through the daemon"


def _chromium() -> object:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    return sync_api


def test_a_preview_url_opens_in_headless_chromium_with_its_websocket(
    pair: tuple[Sandbox, Sandbox],
) -> None:
    sync_api = _chromium()
    a, b = pair
    url_a, url_b = a.preview_url(PORT, ttl_s=300), b.preview_url(PORT, ttl_s=300)
    with sync_api.sync_playwright() as p:  # type: ignore[attr-defined]
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url_a + "page")
            assert "hello from alpha at /page" in page.content()
            page.goto(url_b)
            assert "hello from beta at /" in page.content()
            echoed = page.evaluate(
                """url => new Promise((resolve, reject) => {
                    const ws = new WebSocket(url.replace(/^http/, "ws") + "ws");
                    ws.onopen = () => ws.send("from the browser");
                    ws.onmessage = e => { resolve(e.data); ws.close(); };
                    ws.onerror = () => reject(new Error("websocket failed"));
                })""",
                url_b,
            )
            assert echoed == "from the browser"
        finally:
            browser.close()


def test_previews_on_the_daemons_origin_keep_their_cookies_and_urls_to_themselves(
    pair: tuple[Sandbox, Sandbox],
) -> None:
    """Issue 35: a preview page of A set a cookie for the whole origin that B's guest then
    received, and B learnt A's preview URL (its token) from Referer. In a real browser:
    B's guest gets its own cookies back, under their own names, and nothing of A's."""
    sync_api = _chromium()
    a, b = pair
    url_a, url_b = a.preview_url(PORT, ttl_s=300), b.preview_url(PORT, ttl_s=300)
    seen_by_b = """u => fetch(u).then(r => r.json())"""
    with sync_api.sync_playwright() as p:  # type: ignore[attr-defined]
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url_b + "cookies")  # B's own cookies, set by its answer
            page.goto(url_a + "page")
            page.evaluate("document.cookie = 'tossed=fromA; path=/'")
            from_a = dict(page.evaluate(seen_by_b, url_b + "headers"))  # A's page asks B
            page.goto(url_b + "headers")  # a navigation from A's page to B's
            navigated = dict(json.loads(page.inner_text("body")))
        finally:
            browser.close()
    for sent in (from_a, navigated):
        assert "referer" not in sent, sent  # A's URL, token and all, is not B's to see
        cookies = sorted(c.strip() for c in sent.get("cookie", "").split(";"))
        assert cookies == ["session=abc", "theme=dark"], sent


def test_forkd_port_forward_tunnels_curl(pair: tuple[Sandbox, Sandbox], daemon: Daemon) -> None:
    a, _ = pair
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    cmd = [sys.executable, "-m", "forkd.cli", "port-forward", a.id, f"0:{PORT}", "--json"]
    proc = subprocess.Popen(cmd, env=daemon.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        local = json.loads(proc.stdout.readline())["local_port"]
        for path in ("/one", "/two"):
            out = subprocess.run(
                ["curl", "-sS", "--max-time", "30", f"http://127.0.0.1:{local}{path}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert out == f"hello from alpha at {path}\n"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_tampered_expired_or_dead_preview_url_is_refused(
    pair: tuple[Sandbox, Sandbox], ctl: Controller
) -> None:
    """Last in the module: it kills the second child."""
    a, b = pair
    token = ctl.create_preview_url(a.id, PORT)["token"]
    parts = token.split(".")
    base = ctl.base_url
    other_port = ".".join([*parts[:2], "8001", *parts[3:]])
    other_sandbox = ".".join([parts[0], b.id, *parts[2:]])
    for forged in (other_port, other_sandbox):
        assert httpx.get(f"{base}/v1/preview/{forged}/").status_code == 403
    short = ctl.create_preview_url(a.id, PORT, ttl_s=1)["url"]
    time.sleep(1.5)
    assert httpx.get(short).status_code == 403
    url_b = b.preview_url(PORT)
    assert httpx.get(url_b).status_code == 200
    b.kill()
    assert httpx.get(url_b).status_code in (403, 404)


def test_user_mode_networking_forwards_a_loopback_port_on_first_use(
    fleet: Fleet, base_snapshot: Path
) -> None:
    """A VM without a namespace (QEMU's user-mode NAT, as ``--network user``): the
    daemon's way in is a QEMU host forward to 127.0.0.1, added once per port."""
    vm = fleet.fork(base_snapshot)
    assert vm.net is None
    fleet.loop.run(
        vm.guest.exec(
            ["sh", "-c", "cd /tmp && nohup python3 -m http.server 8000 >/dev/null 2>&1 &"]
        )
    )
    host, port = fleet.loop.run(vm.guest_port_address(8000))
    assert host == "127.0.0.1"
    assert fleet.loop.run(vm.guest_port_address(8000)) == (host, port)  # added once
    deadline = time.monotonic() + 60
    while True:
        try:
            r = httpx.get(f"http://{host}:{port}/", timeout=10)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "http.server never answered"
            time.sleep(0.3)
    assert r.status_code == 200 and "Directory listing" in r.text
    other = fleet.loop.run(vm.guest_port_address(8001))
    assert other[1] != port
    fleet.loop.run(vm.kill())
