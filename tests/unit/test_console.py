"""The web console's files: served without the token (they hold no data) and only
them, with headers that keep this origin's other pages (guests' preview pages) away."""

from __future__ import annotations

from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from tests.unit.conftest import TOKEN
from tests.unit.fakes import FakeDriver


def test_console_files_need_no_token_and_carry_the_headers(
    settings: Settings, driver: FakeDriver
) -> None:
    with TestClient(create_app(settings, TOKEN, driver=driver)) as anonymous:
        assert anonymous.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
        page = anonymous.get("/ui/")
        assert page.status_code == 200 and "forkd console" in page.text
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["cross-origin-opener-policy"] == "same-origin"
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert "set-cookie" not in page.headers
        script = anonymous.get("/ui/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith(
            "text/javascript"
        )
        assert anonymous.get("/ui/style.css").status_code == 200
        # Nothing else under /ui, and the data still needs the token.
        assert anonymous.get("/ui/../v1/snapshots").status_code in (401, 404)
        assert anonymous.get("/ui/console.py").status_code in (401, 404)
        assert anonymous.get("/v1/snapshots").status_code == 401
        assert anonymous.post("/ui/").status_code in (401, 405)
