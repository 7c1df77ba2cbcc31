"""A guest's page in a real browser (Debian's chromium, headless, driven by Playwright),
served through a preview URL on the daemon's own origin: it cannot reach into a console
window it opens, although it asks for the console's own opener policy."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.unit import port_fixtures

CHROMIUM = "/usr/bin/chromium"
GUEST_PORT = port_fixtures.GUEST_PORT
web, http, sid = port_fixtures.web, port_fixtures.http, port_fixtures.sid


def test_a_preview_page_cannot_reach_into_a_console_window_it_opens(
    http: httpx.Client, sid: str
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    r = http.post(f"/v1/sandboxes/{sid}/preview-urls", json={"port": GUEST_PORT})
    url = r.json()["url"] + "opener"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url)
            deadline = time.monotonic() + 20
            while page.title() == "opening":
                assert time.monotonic() < deadline, "the guest's page never reported"
                time.sleep(0.1)
            assert page.title() == "cut off"  # not "reached:<the console's title>"
        finally:
            browser.close()
