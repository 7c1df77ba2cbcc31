"""The audit log stays bounded whatever clients send, and never fails a request.

A full device (``/dev/full`` answers every write with ENOSPC), injected I/O
errors, a flood of unauthenticated requests and very long paths, against the
log alone and under the real app.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.audit import AuditLog
from forkd.controller.settings import Settings
from forkd.limits import (
    AUDIT_401_CLIENTS,
    AUDIT_401_PER_SEC,
    AUDIT_FIELD_LIMIT,
    AUDIT_LOG_MAX_BYTES,
)
from tests.unit.conftest import TOKEN, Server
from tests.unit.fakes import FakeDriver

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Clock:
    """Stands in for time.monotonic in the audit module: seconds we choose."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("forkd.controller.audit.time.monotonic", lambda: self.now)


# ------------------------------------------------------------ bounded lines


def test_long_client_fields_are_cut(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    long_path = "/v1/sandboxes/" + "a" * 100_000
    log.write(
        method="GET",
        path=long_path,
        status=404,
        sandbox_id="a" * 100_000,
        client="c" * 5000,
        duration_ms=1.0,
    )
    log.close()
    (line,) = (tmp_path / "audit.log").read_text().splitlines()
    assert len(line) < 4 * AUDIT_FIELD_LIMIT + 300
    rec = json.loads(line)
    assert rec["path"].startswith(long_path[:AUDIT_FIELD_LIMIT])
    assert rec["path"].endswith(f"...(+{len(long_path) - AUDIT_FIELD_LIMIT} chars)")
    assert rec["sandbox_id"].endswith("...(+99744 chars)")
    assert rec["client"].startswith("c" * AUDIT_FIELD_LIMIT) and rec["status"] == 404


def test_a_newline_in_a_path_stays_inside_its_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    log.write(method="GET", path='/x\n{"forged":true}', status=404)
    log.close()
    (rec,) = _records(tmp_path / "audit.log")
    assert rec["path"] == '/x\n{"forged":true}'


# ------------------------------------------------------------ 401 flood


def test_401s_are_rate_limited_per_client_then_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(monkeypatch)
    log = AuditLog(tmp_path / "audit.log")
    for _ in range(500):
        log.write(method="GET", path="/v1/snapshots", status=401, client="10.0.0.1")
    for _ in range(3):
        log.write(method="GET", path="/v1/snapshots", status=401, client="10.0.0.2")
    log.write(method="GET", path="/v1/snapshots", status=200, client="10.0.0.1")  # never held back
    records = _records(tmp_path / "audit.log")
    by_1 = [r for r in records if r.get("client") == "10.0.0.1" and r["status"] == 401]
    assert len(by_1) == AUDIT_401_PER_SEC
    assert len([r for r in records if r.get("client") == "10.0.0.2"]) == 3
    assert records[-1]["status"] == 200
    assert not any("suppressed" in r for r in records)  # the second is not over yet

    clock.now += 1  # the next second: the next line brings the summary
    log.write(method="GET", path="/version", status=200, client="10.0.0.3")
    summary, last = _records(tmp_path / "audit.log")[-2:]
    assert summary["client"] == "10.0.0.1" and summary["suppressed"] == 500 - AUDIT_401_PER_SEC
    assert summary["message"] == f"{500 - AUDIT_401_PER_SEC} more 401s suppressed"
    assert last["client"] == "10.0.0.3"

    for _ in range(AUDIT_401_PER_SEC + 5):  # a new second, a new allowance
        log.write(method="GET", path="/", status=401, client="10.0.0.1")
    log.close()  # the summary of the last second is written at shutdown
    records = _records(tmp_path / "audit.log")
    assert records[-1]["suppressed"] == 5


def test_varying_the_address_does_not_escape_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Addresses are cheap (IPv6, or X-Forwarded-For, which uvicorn trusts from loopback)."""
    clock = Clock(monkeypatch)
    log = AuditLog(tmp_path / "audit.log")
    for i in range(5000):
        log.write(method="GET", path="/", status=401, client=f"fd00::{i:x}")
    clock.now += 1
    log.write(method="GET", path="/", status=200, client="::1")
    log.close()
    records = _records(tmp_path / "audit.log")
    denied = [r for r in records if r["status"] == 401 and "suppressed" not in r]
    summaries = [r for r in records if "suppressed" in r]
    assert len(denied) == AUDIT_401_CLIENTS + AUDIT_401_PER_SEC  # 64 apart, the rest as one
    assert summaries == [
        {**summaries[0], "client": "other addresses", "suppressed": 5000 - len(denied)}
    ]
    assert (tmp_path / "audit.log").stat().st_size < 20_000


def test_a_flood_of_unauthenticated_requests_writes_little(
    server: Server, settings: Settings
) -> None:
    audit_path = settings.state_dir / "audit.log"
    before = len(audit_path.read_text().splitlines())
    flood = 400
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for _ in range(flood):
            assert c.get("/v1/snapshots").status_code == 401
        time.sleep(1.1)  # the flood's second is over: the next line brings the summary
        r = c.get("/v1/snapshots", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
    deadline = time.monotonic() + 10  # the line is written just after the answer is sent
    while _records(audit_path)[-1]["status"] != 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    records = _records(audit_path)[before:]
    denied = [r for r in records if r["status"] == 401 and "suppressed" not in r]
    suppressed = sum(r.get("suppressed", 0) for r in records)
    assert len(denied) + suppressed == flood  # every refusal is accounted for
    assert len(denied) < flood // 4  # but few are written one by one
    assert records[-1]["status"] == 200
    assert audit_path.stat().st_size < 40_000


# ------------------------------------------------------------ rotation


def test_the_log_rotates_by_size_and_keeps_a_bounded_number_of_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path, max_bytes=2000, files=3)
    for i in range(300):
        log.write(method="GET", path=f"/v1/sandboxes/sb-{i}", status=200, n=i)
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["audit.log", "audit.log.1", "audit.log.2", "audit.log.3"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    kept = [r["n"] for name in reversed(names) for r in _records(tmp_path / name)]
    assert kept == list(range(300 - len(kept), 300))  # the newest, in order, none torn
    assert log.lost == 0


def test_a_rotation_that_fails_loses_lines_instead_of_growing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path, max_bytes=1000, files=2)

    def refuse(*_a: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("forkd.controller.audit.os.replace", refuse)
    with caplog.at_level(logging.WARNING, logger="forkd.controller.audit"):
        for i in range(100):
            log.write(method="GET", path="/v1/snapshots", status=200, n=i)
    assert path.stat().st_size <= 1000 and log.lost > 80
    assert len(caplog.records) == 1 and "Read-only file system" in caplog.text
    monkeypatch.undo()
    log.write(method="GET", path="/v1/snapshots", status=200, n=100)  # rotation works again
    log.close()
    assert _records(path)[-1]["n"] == 100 and (tmp_path / "audit.log.1").exists()


def test_operators_set_the_size_and_file_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORKD_AUDIT_LOG_MAX_MIB", "3")
    monkeypatch.setenv("FORKD_AUDIT_LOG_FILES", "9")
    log = AuditLog(tmp_path / "audit.log")
    assert (log.max_bytes, log.files) == (3 << 20, 9)
    log.close()
    monkeypatch.setenv("FORKD_AUDIT_LOG_MAX_MIB", "lots")
    log = AuditLog(tmp_path / "audit.log")
    assert log.max_bytes == AUDIT_LOG_MAX_BYTES
    log.close()


# ------------------------------------------------------------ failed writes


@needs_dev_full
def test_a_full_device_loses_lines_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "audit.log"
    path.symlink_to("/dev/full")
    log = AuditLog(path)
    with caplog.at_level(logging.WARNING, logger="forkd.controller.audit"):
        for _ in range(1000):
            log.write(method="GET", path="/v1/snapshots", status=200)
    log.close()
    assert log.lost == 1000
    (warning,) = caplog.records
    assert "No space left on device" in warning.getMessage()


def test_an_io_error_or_a_closed_log_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = AuditLog(tmp_path / "audit.log")

    def eio(*_a: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("forkd.controller.audit.os.write", eio)
    log.write(method="GET", path="/a", status=200)
    monkeypatch.undo()
    log.write(method="GET", path="/b", status=200, odd=object())  # not JSON: str() of it

    def broken(*_a: Any, **_k: Any) -> str:
        raise ValueError("a bug in the audit log")

    monkeypatch.setattr("forkd.controller.audit.json.dumps", broken)
    log.write(method="GET", path="/bug", status=200)
    monkeypatch.undo()
    log.close()
    log.write(method="GET", path="/c", status=200)  # after shutdown: lost, not reopened
    assert log.lost == 3
    assert [r["path"] for r in _records(tmp_path / "audit.log")] == ["/b"]


def test_a_short_write_does_not_glue_two_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = AuditLog(tmp_path / "audit.log")
    real_write = os.write
    monkeypatch.setattr(
        "forkd.controller.audit.os.write", lambda fd, data: real_write(fd, data[:10])
    )
    log.write(method="GET", path="/torn", status=200)
    monkeypatch.undo()
    log.write(method="GET", path="/whole", status=200)
    log.close()
    torn, whole = (tmp_path / "audit.log").read_text().splitlines()
    assert len(torn) == 10 and json.loads(whole)["path"] == "/whole"
    assert log.lost == 1


@needs_dev_full
def test_the_daemon_answers_as_usual_when_the_audit_log_cannot_be_written(
    settings: Settings, driver: FakeDriver, caplog: pytest.LogCaptureFixture
) -> None:
    settings.state_dir.mkdir(parents=True)
    (settings.state_dir / "audit.log").symlink_to("/dev/full")
    app = create_app(settings, TOKEN, driver=driver)
    with (
        caplog.at_level(logging.WARNING, logger="forkd.controller.audit"),
        TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c,
    ):
        r = c.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128})
        assert r.status_code == 201, r.text
        assert c.post("/v1/sandboxes", json={"snapshot_tag": "py"}).status_code == 201
        assert c.get("/v1/snapshots").status_code == 200
        assert c.get("/v1/sandboxes/nope").status_code == 404
        assert c.get("/v1/snapshots", headers={"Authorization": "Bearer no"}).status_code == 401
        assert c.post("/v1/snapshots", content=b"x" * (2 << 20)).status_code == 413
        assert app.state.audit.lost == 6
    warnings = [r for r in caplog.records if r.name == "forkd.controller.audit"]
    assert len(warnings) == 1
