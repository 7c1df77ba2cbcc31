"""Fixtures for unit tests: the real daemon app over a fake VM driver.

``client`` drives the app in-process (Starlette's TestClient); ``server``
runs it under a real uvicorn on a loopback port, for the SDK and the CLI.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from forkd.controller.app import create_app
from forkd.controller.settings import Settings
from tests.unit.fakes import FakeDriver, make_image

TOKEN = "unit-test-token"


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    cache = tmp_path / "cache"
    make_image(cache)
    monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
    state = tmp_path / "state"
    return Settings(
        state_dir=state, snapshot_root=state / "snapshots", run_dir=state / "run", pool_size=0
    )


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def client(settings: Settings, driver: FakeDriver) -> Iterator[TestClient]:
    app = create_app(settings, TOKEN, driver=driver)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@dataclass
class Server:
    url: str
    token: str
    token_file: Path
    driver: FakeDriver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(settings: Settings, driver: FakeDriver, tmp_path: Path) -> Iterator[Server]:
    """The app under a real uvicorn on 127.0.0.1, in a thread of this process."""
    port = _free_port()
    app = create_app(settings, TOKEN, driver=driver)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    yield Server(f"http://127.0.0.1:{port}", TOKEN, token_file, driver)
    srv.should_exit = True
    thread.join(10)
