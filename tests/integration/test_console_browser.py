"""The web console in a real browser (Debian's chromium, headless, driven by Playwright)
against the suite's daemon: connect with the token, fork two children from the template,
branch one, and watch the lineage tree show both and then the branch under the template.
A screenshot is kept in test-artifacts/ (or $FORKD_ARTIFACTS_DIR)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller, ControllerError

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(
    os.environ.get("FORKD_ARTIFACTS_DIR", Path(__file__).parents[2] / "test-artifacts")
)


def test_fork_two_and_branch_one_in_the_console(daemon: Any, api_template: str) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    ctl = Controller(daemon.url, token=daemon.token)
    before = {s["id"] for s in ctl.list_sandboxes()}
    at_start = set(before)  # whatever this test forks goes at its end, even on a failure
    new: list[str] = []
    branch_tag = explore_tag = None
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 800})
                page.goto(f"{daemon.url}/ui")
                page.fill("#token", daemon.token)
                page.click("#login button[type=submit]")
                row = page.locator(f'li[data-snapshot="{api_template}"]').first
                row.wait_for(timeout=15_000)
                assert page.locator("#login").is_hidden()  # the token field is gone
                # A fork by another client shows up too: the page follows the event stream.
                [outside] = ctl.spawn_sandboxes(api_template)
                new.append(outside["id"])
                page.locator(f'li[data-sandbox="{outside["id"]}"]').wait_for(timeout=10_000)
                before.add(outside["id"])

                row.locator("> .row input.n").fill("2")
                row.locator("> .row button", has_text="fork").click()
                try:
                    page.wait_for_function(
                        """([tag, before]) => [...document.querySelectorAll(
                            `li[data-snapshot="${tag}"] > ul > li.sandbox`)]
                            .filter(li => !before.includes(li.dataset.sandbox)).length === 2""",
                        arg=[api_template, sorted(before)],
                        timeout=60_000,
                    )
                except sync_api.TimeoutError as exc:  # say what the page and daemon said
                    listed = sorted({s["id"] for s in ctl.list_sandboxes()} - before)
                    raise AssertionError(
                        f"the console showed no 2 new forks: its status line said "
                        f"{page.inner_text('#status')!r}; the daemon lists {listed}"
                    ) from exc
                mine = sorted({s["id"] for s in ctl.list_sandboxes()} - before)
                assert len(mine) == 2
                new += mine

                kid = page.locator(f'li[data-sandbox="{mine[0]}"]')
                kid.locator("button", has_text="branch").click()
                branch_tag = f"branch-{mine[0]}-1"
                nested = row.locator(f'> ul > li[data-snapshot="{branch_tag}"]')
                nested.wait_for(timeout=60_000)  # the tree updated: the branch sits under py
                assert "paused" in nested.locator("> .row .meta").inner_text()
                page.wait_for_function(  # and its source counts the branch
                    'id => document.querySelector(`li[data-sandbox="${id}"] .meta`)'
                    "?.textContent.includes('1 branch')",
                    arg=mine[0],
                    timeout=10_000,
                )
                # An explore's children show their variant and score in the tree (of the
                # SDK's sandbox: it runs; the console's may still be starting).
                variants = [{"eval": "s = 3"}, {"eval": "s = 5"}]
                explored = ctl.explore_sandbox(outside["id"], variants, {"eval": "s"}, keep=1)
                explore_tag = explored.branch
                winner = str(explored.results[0].sandbox_id)
                new.append(winner)
                page.wait_for_function(
                    'id => document.querySelector(`li[data-sandbox="${id}"] .badge.search`)'
                    "?.textContent === 'variant 1 · score 5'",
                    arg=winner,
                    timeout=10_000,
                )
                page.wait_for_function(  # what each sandbox uses, from its metrics
                    "id => /host \\d+ MiB/.test(document.querySelector("
                    '`li[data-sandbox="${id}"] .usage`)?.textContent ?? "")',
                    arg=mine[1],
                    timeout=30_000,
                )
                page.select_option("#exec-sandbox", mine[1])
                page.fill("#exec-command", "echo from the console")
                page.click("#exec-form button[type=submit]")
                page.wait_for_function(
                    "() => document.querySelector('#exec-output').textContent.includes('[exit 0]')",
                    timeout=30_000,
                )
                assert "from the console" in page.inner_text("#exec-output")
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                shot = ARTIFACTS / "console.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
            finally:
                browser.close()
    finally:
        new += sorted({s["id"] for s in ctl.list_sandboxes()} - at_start - set(new))
        for sid in new:
            with contextlib.suppress(ControllerError):
                ctl.kill_sandbox(sid)
        for tag in (branch_tag, explore_tag):
            if tag:
                with contextlib.suppress(ControllerError):
                    ctl.delete_snapshot(tag)
        ctl.close()
