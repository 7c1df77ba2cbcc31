"""What the daemon refuses over HTTP, and that a refusal changes nothing.

The token on every route but /healthz, bad names, counts, paths and bodies,
and the 1 MiB limit on JSON bodies, sent with a Content-Length and chunked.
The real app under uvicorn on loopback, over the fake VM driver: none of
this needs a VM.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forkd.agent_wire import ExecAnswer
from forkd.controller.settings import Settings
from forkd.errors import SnapshotError
from tests.unit.conftest import Server


def _client(server: Server, token: str | None = "ok") -> httpx.Client:
    headers = {}
    if token == "ok":
        headers["Authorization"] = f"Bearer {server.token}"
    elif token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def _state(server: Server, settings: Settings) -> dict[str, Any]:
    """Everything a bad request must leave unchanged: registry and disk."""
    with _client(server) as c:
        snaps = sorted(s["tag"] for s in c.get("/v1/snapshots").json())
        boxes = sorted(b["id"] for b in c.get("/v1/sandboxes").json())
    on_disk = sorted(p.name for p in settings.snapshot_root.iterdir())
    return {"snapshots": snaps, "sandboxes": boxes, "disk": on_disk}


@pytest.fixture
def py(server: Server) -> str:
    """A template ``py`` on the daemon."""
    with _client(server) as c:
        r = c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128})
    assert r.status_code == 201, r.text
    return "py"


ROUTES = [
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/snapshots"),
    ("POST", "/v1/snapshots"),
    ("GET", "/v1/snapshots/py/info"),
    ("DELETE", "/v1/snapshots/py"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/sb-x-1"),
    ("DELETE", "/v1/sandboxes/sb-x-1"),
    ("POST", "/v1/sandboxes/sb-x-1/ping"),
    ("POST", "/v1/sandboxes/sb-x-1/exec"),
    ("POST", "/v1/sandboxes/sb-x-1/eval"),
    ("POST", "/v1/sandboxes/sb-x-1/branch"),
    ("GET", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("PUT", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("DELETE", "/v1/sandboxes/sb-x-1/files?path=/a"),
    ("GET", "/v1/sandboxes/sb-x-1/files/list?path=/"),
    ("GET", "/no/such/route"),
]


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_route_but_healthz_needs_the_token(
    server: Server, settings: Settings, py: str, token: str | None
) -> None:
    before = _state(server, settings)
    with _client(server, token) as c:
        assert c.get("/healthz").json() == {"ok": True}
        for method, path in ROUTES:
            r = c.request(method, path, json={} if method in ("POST", "PUT") else None)
            assert r.status_code == 401, (method, path, r.status_code)
            assert "error" in r.json()
    assert _state(server, settings) == before


BAD_TAGS = ["../x", "", "a" * 65, "has space", "x/y", "é"]


def test_bad_input_is_refused_and_changes_nothing(
    server: Server, settings: Settings, py: str
) -> None:
    with _client(server) as c:
        box = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
        before = _state(server, settings)
        cases: list[tuple[str, str, dict[str, Any], Any, int]] = []
        for tag in BAD_TAGS:
            cases += [
                ("POST", "/v1/snapshots", {}, {"tag": tag}, 400),
                ("POST", "/v1/sandboxes", {}, {"snapshot_tag": tag}, 400),
                ("POST", f"/v1/sandboxes/{box}/branch", {}, {"tag": tag}, 400),
            ]
        cases += [
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "py", "n": 0}, 400),
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "py", "n": 1001}, 400),
            ("POST", "/v1/sandboxes", {}, {"snapshot_tag": "nope"}, 404),
            ("POST", "/v1/snapshots", {}, {"tag": "py"}, 409),
            ("GET", "/v1/snapshots/nope/info", {}, None, 404),
            ("DELETE", "/v1/snapshots/nope", {}, None, 404),
            ("GET", "/v1/sandboxes/sb-nope-0001", {}, None, 404),
            ("DELETE", "/v1/sandboxes/sb-nope-0001", {}, None, 404),
            ("POST", "/v1/sandboxes/sb-nope-0001/exec", {}, {"args": ["true"]}, 404),
            ("POST", "/v1/sandboxes/sb-nope-0001/branch", {}, {}, 404),
            ("POST", f"/v1/sandboxes/{box}/exec", {}, {"args": []}, 400),
            ("POST", f"/v1/sandboxes/{box}/branch", {}, {"mode": "incremental"}, 400),
            ("POST", f"/v1/sandboxes/{box}/branch", {}, {"wait": "later"}, 400),
            ("DELETE", "/v1/snapshots/py", {"cascade": "maybe"}, None, 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "relative/x"}, None, 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "/a\x00b"}, None, 400),
            ("PUT", f"/v1/sandboxes/{box}/files", {"path": "rel"}, b"data", 400),
            ("GET", f"/v1/sandboxes/{box}/files", {"path": "/no/such/file"}, None, 404),
        ]
        for method, path, params, body, want in cases:
            kw: dict[str, Any] = {"params": params}
            if isinstance(body, bytes):
                kw["content"] = body
            elif body is not None:
                kw["json"] = body
            r = c.request(method, path, **kw)
            assert r.status_code == want, (method, path, body, r.status_code, r.text)
            assert isinstance(r.json()["error"], str) and r.json()["error"]
        # Malformed JSON and oversized bodies.
        r = c.post("/v1/sandboxes", content=b'{"snapshot_tag": "py", "n": ')
        assert r.status_code == 400 and "error" in r.json()
        r = c.post(
            "/v1/snapshots", content=b'{"tag": "big", "warmup": "' + b"x" * (1 << 20) + b'"}'
        )
        assert r.status_code == 413 and "error" in r.json()

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit still holds
            yield b'{"tag": "big", "warmup": "'
            yield b"x" * (1 << 20)
            yield b'"}'

        r = c.post("/v1/snapshots", content=chunked())
        assert r.status_code == 413 and "error" in r.json()
        assert _state(server, settings) == before
        assert c.delete(f"/v1/sandboxes/{box}").status_code == 204


# ------------------------------------------------------------ framing an attacker picks


@pytest.fixture
def small_uploads(settings: Settings) -> Settings:
    """Uploads capped at 64 MiB; requested before ``server``, which starts the app."""
    settings.max_upload_bytes = 64 << 20
    return settings


def test_a_smuggled_body_is_refused_and_changes_nothing(
    small_uploads: Settings, server: Server, settings: Settings, py: str
) -> None:
    """Content-Length beside chunked framing, and a Content-Length shorter than
    the body, sent over a raw socket as httpx never would. A file upload
    streams, so its chunked body is cut at the upload limit, not at 10 bytes."""
    from tests.unit.test_middleware import _chunked, _exchange, _plain

    port = int(server.url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {server.token}\r\n"
    with _client(server) as c:
        box = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
    before = _state(server, settings)

    head = (
        f"PUT /v1/sandboxes/{box}/files?path=/big HTTP/1.1\r\nHost: x\r\n{auth}"
        "Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    ex = _exchange(port, head, _chunked(200 << 20, piece=1 << 20))
    assert ex.status in (413, None) and ex.closed, ex.answer
    assert ex.sent < 200 << 20

    def big_json() -> Iterator[bytes]:  # a valid template request of 8 MiB
        body = b'{"tag": "big", "warmup": "' + b"x" * (8 << 20) + b'"}'
        yield b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"

    head = (
        f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{auth}"
        "Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    ex = _exchange(port, head, big_json())
    assert ex.status in (413, None) and ex.closed, ex.answer

    head = f"POST /v1/snapshots HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 10\r\n\r\n"
    ex = _exchange(port, head, iter([b'{"tag": "big"}', *_plain(8 << 20)]))
    assert ex.status == 400, ex.answer  # the app got '{"tag": "b': not JSON

    assert _state(server, settings) == before
    with _client(server) as c:
        r = c.get(f"/v1/sandboxes/{box}/files", params={"path": "/big"})
        assert r.status_code == 404, "the smuggled upload reached the guest"


# ------------------------------------------------------------ 500s


def test_an_unexpected_error_answers_with_an_id_and_logs_the_details(
    server: Server, py: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _client(server) as c:
        box = c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"]
        vm = server.driver.vms[-1]

        async def broken(*_a: Any, **_k: Any) -> ExecAnswer:
            raise RuntimeError("secret detail: /var/lib/forkd/run/x")

        vm.exec = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="forkd.controller.http_errors"):
            r = c.post(f"/v1/sandboxes/{box}/exec", json={"args": ["true"]})
        assert r.status_code == 500
        m = re.fullmatch(
            r"internal error \(id ([0-9a-f]{8})\); the daemon log has the details",
            r.json()["error"],
        )
        assert m, r.json()
        assert "secret" not in r.text
        (record,) = [rec for rec in caplog.records if m.group(1) in rec.getMessage()]
        assert f"POST /v1/sandboxes/{box}/exec" in record.getMessage()
        assert record.exc_info and "secret detail" in str(record.exc_info[1])
        # Another failure, another id.
        r2 = c.post(f"/v1/sandboxes/{box}/exec", json={"args": ["true"]})
        assert r2.status_code == 500 and m.group(1) not in r2.json()["error"]


def test_a_deliberate_500_keeps_its_message(server: Server, py: str) -> None:
    server.driver.fail_restore = SnapshotError("memory.bin is corrupt")
    with _client(server) as c:
        r = c.post("/v1/sandboxes", json={"snapshot_tag": "py", "n": 2})
    assert r.status_code == 500
    assert "none were kept" in r.json()["error"] and "memory.bin is corrupt" in r.json()["error"]
