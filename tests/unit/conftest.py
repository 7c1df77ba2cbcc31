"""Fixtures for unit tests: the real daemon app over a fake VM driver.

``client`` drives the app in-process (Starlette's TestClient); ``server``
runs it under a real uvicorn on a loopback port, for the SDK and the CLI.
:class:`RecordingTransport` sends over the network like httpx's own and keeps
each request, for tests of what a client sent.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import uvicorn
from fastapi.testclient import TestClient
from starlette.types import ASGIApp
from typer.testing import CliRunner, Result

from forkd.client import Controller
from forkd.controller.app import create_app
from forkd.controller.e2b.app import create_e2b_app
from forkd.controller.settings import Settings
from forkd.launcher import free_port
from tests.unit.fake_images import FakeImporter
from tests.unit.fakes import FakeDriver, make_image

TOKEN = "unit-test-token"


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    cache = tmp_path / "cache"
    make_image(cache)
    monkeypatch.setenv("FORKD_CACHE_DIR", str(cache))
    state = tmp_path / "state"
    # A client finds no token of a real daemon on this host (/var/lib/forkd/token).
    monkeypatch.setenv("FORKD_STATE_DIR", str(tmp_path / "client-state"))
    return Settings(
        state_dir=state,
        snapshot_root=state / "snapshots",
        run_dir=state / "run",
        pool_size=0,
        cgroup_root=tmp_path / "no-cgroups",  # the host's own limits stay out of the tests
    )


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


@pytest.fixture
def importer() -> FakeImporter:
    """The daemon's container image importer: a fake one, never the network."""
    return FakeImporter()


@pytest.fixture
def client(settings: Settings, driver: FakeDriver, importer: FakeImporter) -> Iterator[TestClient]:
    app = create_app(settings, TOKEN, driver=driver, importer=importer)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@dataclass
class Server:
    url: str
    token: str
    token_file: Path
    driver: FakeDriver
    importer: FakeImporter
    app: Any = None  # the daemon's app: its services, for what no route shows


@contextmanager
def serving(app: ASGIApp, **config: Any) -> Iterator[None]:
    """``app`` under a real uvicorn in a thread of this process, for the block.

    ``config`` says where it listens: ``host=`` and ``port=``, or ``uds=``.
    """
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield
    finally:
        srv.should_exit = True
        thread.join(10)


@pytest.fixture
def server(
    settings: Settings, driver: FakeDriver, importer: FakeImporter, tmp_path: Path
) -> Iterator[Server]:
    """The app under a real uvicorn on 127.0.0.1, in a thread of this process."""
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    app = create_app(settings, TOKEN, driver=driver, importer=importer)
    with serving(app, host="127.0.0.1", port=port):
        yield Server(f"http://127.0.0.1:{port}", TOKEN, token_file, driver, importer, app)


class RecordingTransport(httpx.HTTPTransport):
    """httpx's network transport that keeps every request it sends.

    The answers come from whatever listens at the client's URL; a client
    closed with it may hand it to the next one.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return super().handle_request(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def body(self, i: int = -1) -> Any:
        """The JSON body of request ``i`` (default: the last)."""
        return json.loads(self.requests[i].content)


@pytest.fixture
def sent() -> RecordingTransport:
    """A transport for an SDK client: the requests it sent, the real app's answers."""
    return RecordingTransport()


@pytest.fixture
def ctl(server: Server) -> Iterator[Controller]:
    """The SDK, to set the daemon up and look at it (a module may define its own: one
    that records what it sent, or starts with a template)."""
    with Controller(server.url, token=server.token) as c:
        yield c


# ``py`` and ``sid`` use the ``ctl`` of the module that asks.


@pytest.fixture
def py(ctl: Controller) -> str:
    """A template ``py`` on the daemon."""
    ctl.create_snapshot("py", memory_mib=128)
    return "py"


@pytest.fixture
def sid(ctl: Controller, py: str) -> str:
    """A running sandbox forked from ``py``."""
    return str(ctl.spawn_sandboxes(py)[0]["id"])


def fake_meminfo(path: Path, total_mib: int, available_mib: int) -> None:
    path.write_text(
        f"MemTotal:       {total_mib << 10} kB\nMemFree:  1 kB\n"
        f"MemAvailable:   {available_mib << 10} kB\n"
    )


@pytest.fixture
def meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A /proc/meminfo the test writes (admission and reclaim read it): a 4 GiB host
    with 1000 MiB available."""
    from forkd.controller.services import host_memory

    path = tmp_path / "meminfo"
    fake_meminfo(path, 4096, 1000)
    monkeypatch.setattr(host_memory, "MEMINFO", path)
    return path


# -- the CLI's daemon commands against ``server`` ------------------------------------

runner = CliRunner()
Invoke = Callable[..., Result]


def make_app(transport: RecordingTransport | None) -> typer.Typer:
    """The CLI's daemon commands, their requests sent through ``transport`` (None: the
    network, as the CLI sends them)."""
    from forkd import cli

    app = typer.Typer()

    @app.command("version")  # as in forkd.cli: more than one command keeps subcommands
    def version() -> None:
        pass

    cli.add_daemon_commands(app, transport=transport)
    return app


def env_of(server: Server) -> dict[str, str]:
    return {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}


@pytest.fixture
def forkd(server: Server, sent: RecordingTransport) -> Invoke:
    """Run a daemon command that finds the daemon through the environment."""
    app = make_app(sent)

    def invoke(*args: str) -> Result:
        return runner.invoke(app, list(args), env=env_of(server))

    return invoke


E2B_UPLOAD_LIMIT = 64 << 20  # of one upload through the E2B port


@pytest.fixture
def e2b_url(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The E2B port of the ``server`` daemon, with a snapshot tagged ``base`` to create
    sandboxes from; the SDK's variables point at it."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        made = c.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
        assert made.status_code == 201, made.text
    port = free_port()
    app = create_e2b_app(server.app, TOKEN, E2B_UPLOAD_LIMIT, domain=f"localhost:{port}")
    with serving(app, host="127.0.0.1", port=port, lifespan="off"):
        url = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("E2B_API_URL", url)
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        monkeypatch.setenv("E2B_API_KEY", TOKEN)
        yield url
