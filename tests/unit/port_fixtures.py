"""Fixtures of the port tests: a loopback web service playing a guest port, and a
sandbox whose guest port 8000 is that service."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.launcher import free_port
from tests.integration import guest_web
from tests.unit.conftest import TOKEN, Server
from tests.unit.fakes import FakeVM

GUEST_PORT = 8000


@pytest.fixture
def web() -> Iterator[int]:
    """A loopback web service playing the guest's; its port."""
    port = free_port()
    srv = guest_web.make_server("127.0.0.1", port, "the fake guest")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield port
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as c:
        yield c


@pytest.fixture
def sid(http: httpx.Client, server: Server, web: int) -> str:
    """A running sandbox whose guest port 8000 is the ``web`` service."""
    assert http.post("/v1/snapshots", json={"tag": "py", "memory_mib": 128}).status_code == 201
    sandbox_id = str(http.post("/v1/sandboxes", json={"snapshot_tag": "py"}).json()[0]["id"])
    vm(server, sandbox_id).ports[GUEST_PORT] = web
    return sandbox_id


def vm(server: Server, sandbox_id: str) -> FakeVM:
    return next(vm for vm in server.driver.vms if vm.id == sandbox_id)


def last_audit_record(state_dir: Path, method: str) -> dict[str, Any]:
    """The audit log's last record of a ``method`` request; waits for it a little, as
    the line is written once the answer has gone out."""
    deadline = time.monotonic() + 5
    while True:
        lines = (state_dir / "audit.log").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        found = [r for r in records if r["method"] == method]
        if found or time.monotonic() > deadline:
            return found[-1]
        time.sleep(0.05)
