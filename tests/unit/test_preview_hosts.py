"""Preview URLs on hosts of their own (``--preview-domain``), over the real app under
uvicorn and a loopback web service playing the guest's port: each preview is its own
browser origin, which serves that preview and nothing else, and the daemon's own host
serves no preview page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from forkd.controller.services.preview_domain import PreviewDomain
from forkd.controller.settings import Settings
from forkd.errors import Invalid
from tests.unit import port_fixtures
from tests.unit.conftest import Server

GUEST_PORT = port_fixtures.GUEST_PORT
web, http, sid = port_fixtures.web, port_fixtures.http, port_fixtures.sid
DOMAIN = "preview.test"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    settings.preview_domain = PreviewDomain.of(DOMAIN)
    return settings


@pytest.fixture
def anon(server: Server) -> Iterator[httpx.Client]:
    """A browser: no bearer token, and every name resolving to the daemon (the request
    goes to the daemon's address, the ``Host`` header says the name)."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def _get(anon: httpx.Client, url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """``url`` as a browser would fetch it, its host resolved to the daemon."""
    parts = urlsplit(url)
    target = f"{parts.path}?{parts.query}" if parts.query else parts.path
    anon.cookies.clear()  # only what the test sends: the jar knows no Host header
    return anon.get(target, headers={"Host": parts.netloc, **(headers or {})})


def _preview(http: httpx.Client, sandbox_id: str, port: int = GUEST_PORT) -> dict[str, str]:
    r = http.post(f"/v1/sandboxes/{sandbox_id}/preview-urls", json={"port": port})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_a_preview_is_served_on_its_own_host_only(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server
) -> None:
    info = _preview(http, sid)
    daemon_port = urlsplit(server.url).port
    host = f"{GUEST_PORT}-{sid}.{DOMAIN}:{daemon_port}"
    assert info["url"] == f"http://{host}/v1/preview/{info['token']}/"
    r = _get(anon, info["url"] + "deep/path?x=1")
    assert r.status_code == 200 and r.text == "hello from the fake guest at /deep/path?x=1\n"
    # Nothing else on that host: not the API (even with the bearer token), not the console.
    for path in ("/v1/sandboxes", "/ui/", "/healthz"):
        r = _get(
            anon, f"http://{host}{path}", headers={"Authorization": http.headers["Authorization"]}
        )
        assert r.status_code == 404, path
    # Not another port's preview, nor the same token on another sandbox's host.
    other = _preview(http, sid, port=9000)
    assert _get(anon, f"http://{host}{urlsplit(other['url']).path}").status_code == 404
    wrong = f"http://{GUEST_PORT}-sb-000000-0001.{DOMAIN}:{daemon_port}"
    assert _get(anon, f"{wrong}/v1/preview/{info['token']}/").status_code == 404
    # Any other name under the domain serves nothing: no API, no console.
    for name in (f"www.{DOMAIN}", f"a.b.{DOMAIN}", f"{GUEST_PORT}-{sid}.{DOMAIN}."):
        for path in ("/v1/sandboxes", "/ui/", f"/v1/preview/{info['token']}/"):
            r = _get(
                anon,
                f"http://{name}:{daemon_port}{path}",
                headers={"Authorization": http.headers["Authorization"]},
            )
            assert r.status_code == (200 if name.endswith(".") and "preview" in path else 404), (
                name,
                path,
            )


def test_a_page_s_absolute_paths_work_on_its_host_through_the_preview_cookie(
    http: httpx.Client, anon: httpx.Client, sid: str, server: Server
) -> None:
    """A page linking to ``/app.js`` leaves its prefix: on its own host the preview URL's
    answer set a cookie holding the token, which serves the host's other paths."""
    info = _preview(http, sid)
    first = _get(anon, info["url"])
    cookie = first.headers["set-cookie"]
    assert cookie.startswith(f"forkd-preview={info['token']}; Path=/; Max-Age=")
    assert cookie.endswith("; HttpOnly; SameSite=Lax")
    host = urlsplit(info["url"]).netloc
    root = f"http://{host}"
    assert _get(anon, f"{root}/app.js?v=2").status_code == 404  # no cookie: nothing here
    ours = {"Cookie": f"theme=dark; forkd-preview={info['token']}"}
    r = _get(anon, f"{root}/app.js?v=2", headers=ours)
    assert r.status_code == 200 and r.text == "hello from the fake guest at /app.js?v=2\n"
    api = _get(anon, f"{root}/v1/sandboxes", headers=ours)  # the guest's path, not the API
    assert api.text == "hello from the fake guest at /v1/sandboxes\n"
    sent = dict(_get(anon, f"{root}/headers", headers=ours).json())
    assert sent["cookie"] == "theme=dark"  # the token is never the guest's to see
    assert "x-forwarded-prefix" not in sent  # its paths are the host's own
    # Another sandbox's or port's token is no key to this host; a forged one is refused.
    other = _preview(http, sid, port=9000)["token"]
    assert _get(anon, f"{root}/", headers={"Cookie": f"forkd-preview={other}"}).status_code == 404
    forged = info["token"][:-4] + ("AAAA" if not info["token"].endswith("AAAA") else "BBBB")
    assert _get(anon, f"{root}/", headers={"Cookie": f"forkd-preview={forged}"}).status_code == 403


def test_the_daemon_s_host_sends_a_preview_to_its_own_host(
    http: httpx.Client, anon: httpx.Client, sid: str
) -> None:
    info = _preview(http, sid)
    r = anon.get(f"/v1/preview/{info['token']}/a/b%2Fc?q=1", follow_redirects=False)
    assert r.status_code == 307
    assert r.headers["location"] == info["url"] + "a/b%2Fc?q=1"
    assert anon.get("/v1/preview/not-a-token/").status_code == 404  # never served here


def test_a_guest_on_its_own_origin_keeps_its_cookies_paths_and_opener_policy(
    http: httpx.Client, anon: httpx.Client, sid: str
) -> None:
    r = _get(anon, _preview(http, sid)["url"] + "cookies")
    assert r.headers.get_list("set-cookie")[:2] == [
        "session=abc; Path=/; HttpOnly",  # its Domain gone: this host only
        "theme=dark; Max-Age=60; SameSite=Lax",
    ]  # then the preview cookie
    assert r.headers["cross-origin-opener-policy"] == "same-origin"
    assert r.headers["nel"] and r.headers["report-to"]  # its own origin's policy: its own


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("preview.example.com", PreviewDomain("preview.example.com")),
        ("Preview.Example.com:8443", PreviewDomain("preview.example.com", None, 8443)),
        ("https://p.example.com", PreviewDomain("p.example.com", "https")),
    ],
)
def test_a_preview_domain_is_a_dns_name_with_an_optional_scheme_and_port(
    value: str, parsed: PreviewDomain
) -> None:
    assert PreviewDomain.of(value) == parsed
    assert PreviewDomain.of(str(parsed)) == parsed


@pytest.mark.parametrize(
    "value",
    [
        "localhost",
        "ftp://a.example",
        "a.example/path",
        "a.example:99999",
        "u@a.example",
        "-a.example",
        "a_b.example",
        "a.example?x",
        "",
    ],
)
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(Invalid):
        PreviewDomain.of(value)


def test_urls_take_the_scheme_and_port_they_were_asked_by_unless_given() -> None:
    bare, https = PreviewDomain.of("p.example"), PreviewDomain.of("https://p.example")
    assert bare.url("sb-a1-0001", 80, "T", "http://10.0.0.1:8889/") == (
        "http://80-sb-a1-0001.p.example:8889/v1/preview/T/"
    )
    assert bare.url("sb-a1-0001", 80, "T", "https://forkd.example/") == (
        "https://80-sb-a1-0001.p.example/v1/preview/T/"
    )
    assert https.url("sb-a1-0001", 80, "T", "http://127.0.0.1:8889/") == (
        "https://80-sb-a1-0001.p.example/v1/preview/T/"
    )
    assert bare.label_of("80-sb-a1-0001.p.example:8889") == "80-sb-a1-0001"
    assert bare.label_of("80-SB-A1-0001.P.Example.") == "80-sb-a1-0001"  # as DNS reads it
    assert bare.label_of("80-sb-a1-0001.x.p.example") == ""  # under it, not a preview's
    assert bare.label_of("www.p.example") == ""
    assert bare.label_of("p.example") is None and bare.label_of("127.0.0.1:8889") is None


def test_in_a_browser_a_preview_is_an_origin_of_its_own(http: httpx.Client, sid: str) -> None:
    """Debian's chromium, every name under the domain resolved to the daemon: the page's
    origin is its preview host, whose paths are all the guest's (no console), and its
    cookies stay there."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    url = _preview(http, sid)["url"] + "cookies"
    host = urlsplit(url).hostname
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1"],
        )
        try:
            context = browser.new_context()
            page = context.new_page()
            assert page.goto(url).status == 200
            assert page.evaluate("location.host") == urlsplit(url).netloc
            ui = page.evaluate("fetch('/ui/').then(r => r.text())")
            assert ui == "hello from the fake guest at /ui/\n"  # the guest's, not the console
            # A page's absolute link: served by the cookie its preview URL set.
            got = page.evaluate("fetch('/abs/x').then(r => r.text())")
            assert got == "hello from the fake guest at /abs/x\n"
            echoed = page.evaluate("""() => new Promise((ok, no) => {
                const ws = new WebSocket(`ws://${location.host}/ws`);
                ws.onopen = () => ws.send("at the root");
                ws.onmessage = (e) => { ok(e.data); ws.close(); };
                ws.onerror = () => no("the WebSocket failed"); })""")
            assert echoed == "at the root"  # a WebSocket too
            cookies = {c["name"]: c["domain"] for c in context.cookies()}
            assert cookies == {"session": host, "theme": host, "forkd-preview": host}
        finally:
            browser.close()
