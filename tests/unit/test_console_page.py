"""The web console in a real browser (Debian's chromium, headless, driven by Playwright)
against the app under uvicorn with the fake driver: what a guest's page on the same
origin, or a guest's output, could do to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.client import Controller
from forkd.controller.settings import Settings
from tests.unit.conftest import Server
from tests.unit.webhook_receiver import Receiver, receiving

CHROMIUM = "/usr/bin/chromium"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><b id=injected>bold</b>"


@pytest.fixture
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def test_the_token_field_is_masked_but_no_password_a_manager_would_save(
    server: Server, browser: object
) -> None:
    """A saved password is offered to every page of its origin, a guest's preview page
    included (a hidden password field there, and the token is the guest's)."""
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(f"{server.url}/ui/")
    assert page.locator("input[type=password]").count() == 0
    token = page.locator("#token")
    assert token.get_attribute("autocomplete") == "off"
    assert token.evaluate("e => getComputedStyle(e).webkitTextSecurity") == "disc"


def test_a_guests_output_is_shown_as_text(server: Server, sid: str, browser: object) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(f"{server.url}/ui/")
    page.fill("#token", server.token)
    page.click("#login button[type=submit]")
    page.locator(f'#exec-sandbox option[value="{sid}"]').wait_for(state="attached")
    page.fill("#exec-command", HOSTILE)  # the fake guest echoes its command line
    page.click("#exec-form button[type=submit]")
    # the page says "running…" until the answer comes, then the output and "[exit N]"
    page.wait_for_function(
        "() => document.querySelector('#exec-output').textContent.includes('[exit')"
    )
    assert HOSTILE in page.locator("#exec-output").text_content()
    assert page.locator("#injected").count() == 0 and page.title() != "pwned"


def test_the_network_panel_shows_a_sandboxs_policy_and_egress_and_cuts_it_off(
    server: Server, sid: str, browser: object, ctl: Controller
) -> None:
    from forkd.egress.records import EgressRecord

    log = server.app.state.services.egress.proxy.log
    log.add(
        EgressRecord(
            sid,
            "refused",
            "http",
            HOSTILE,
            80,
            reason="not allowed by the sandbox's network policy",
            method="GET",
            path="/x",
        )
    )
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(f"{server.url}/ui/")
    page.fill("#token", server.token)
    page.click("#login button[type=submit]")
    page.locator(f'li[data-sandbox="{sid}"] button', has_text="network").click()
    page.locator("#egress-rows tr").first.wait_for()
    row = page.locator("#egress-rows tr").first.inner_text()
    assert "refused" in row and "GET /x" in row and HOSTILE in row  # as text, never markup
    assert page.locator("#injected").count() == 0
    assert "every public destination" in page.locator("#network-policy").inner_text()
    page.locator("#network-policy button", has_text="cut off").click()
    page.wait_for_function(
        "() => document.querySelector('#network-policy').textContent.includes('deny out: *')"
    )
    assert ctl.sandbox_network(sid)["deny_out"] == ["*"]


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    with receiving() as r:
        yield r


@pytest.fixture
def settings(settings: Settings, hooks: Receiver) -> Settings:
    """The suite's, with the receiver above allowed as a webhook endpoint."""
    return dataclasses.replace(settings, webhook_allow=(f"127.0.0.1:{hooks.port}",))


def test_the_webhooks_panel_adds_shows_tests_and_removes_a_webhook(
    server: Server, browser: object, ctl: Controller, hooks: Receiver
) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    page.goto(f"{server.url}/ui/")
    page.fill("#token", server.token)
    page.click("#login button[type=submit]")
    page.fill("#webhook-url", hooks.url)
    page.fill("#webhook-events", "sandbox.killed sandbox.hibernated")
    page.click("#webhook-form button[type=submit]")
    page.locator("#webhook-list > li").first.wait_for()
    (made,) = ctl.list_webhooks()
    assert made["events"] == ["sandbox.killed", "sandbox.hibernated"]
    shown = page.locator("#webhook-secret").inner_text()
    assert made["id"] in shown and "whsec_" in shown  # shown once, as the daemon made it
    item = page.locator(f'li[data-webhook="{made["id"]}"]')
    assert hooks.url in item.inner_text()

    item.locator("button", has_text="test").click()
    hooks.until(lambda got: len(got) == 1)
    page.wait_for_function(
        "() => document.querySelector('.deliveries').textContent.includes('delivered')"
    )
    assert "webhook.test" in item.locator(".deliveries").inner_text()

    item.locator("button", has_text="remove").click()
    page.wait_for_function("() => document.querySelectorAll('#webhook-list > li').length === 0")
    assert ctl.list_webhooks() == []
