"""Services from container images, as a user runs them: a Python web app built from a real
Dockerfile (ENV, WORKDIR, COPY, RUN useradd, USER, EXPOSE, CMD) made a template by the CLI
(``snapshot create --image docker-daemon:... --start --ready-port``) and forked by it,
every fork serving warm as the image's user in its directory with its environment, each
fork's writes its own; and Debian's PostgreSQL image through the postgres-image recipe
(the SDK's ``Snapshot.create(image=..., start=True, ready_port=5432)``): started, a
fixture loaded and branched, forked three ways, each fork its own database."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.client import Controller
from tests import docker_daemon
from tests.docker_daemon import DockerDaemon
from tests.integration.conftest import Daemon
from tests.integration.image_env import build, image_daemon

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP_TAG = "forkd-test/pyapp:1"
APP_PORT = 8000
DOCKERFILE = f"""\
FROM forkd-test/debian:12
ENV GREETING="hello from the app image" APP_HOME=/srv/app
WORKDIR /srv/app
COPY app.py ./
RUN useradd --uid 1001 --create-home web && mkdir data && chown web:web data
USER web
EXPOSE {APP_PORT}
CMD ["python3", "app.py"]
"""
APP = f"""\
import json, os, pwd
from http.server import BaseHTTPRequestHandler, HTTPServer

hits = 0


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        if self.path == "/hit":
            hits += 1
            body = {{"hits": hits}}
        else:
            body = {{"user": pwd.getpwuid(os.getuid()).pw_name, "cwd": os.getcwd(),
                    "greeting": os.environ.get("GREETING"), "pid": os.getpid()}}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


HTTPServer(("0.0.0.0", {APP_PORT}), Handler).serve_forever()
"""
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"


@pytest.fixture(scope="module")
def docker() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def daemon(docker: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with image_daemon(docker, [], tmp_path_factory.mktemp("archives")) as d:
        yield d


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=900) as c:
        yield c


def cli(daemon: Daemon, *args: str) -> Any:
    """``forkd ARGS --json`` against ``daemon``: its JSON output."""
    proc = subprocess.run(
        [sys.executable, "-m", "forkd.cli", *args, "--json"],
        cwd=ROOT,
        env=daemon.env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_a_python_app_image_serves_from_every_fork_as_its_user(
    docker: DockerDaemon, daemon: Daemon, ctl: Controller
) -> None:
    build(docker, APP_TAG, {"Dockerfile": DOCKERFILE, "app.py": APP})
    made = cli(
        daemon,
        "snapshot",
        "create",
        "--tag",
        "pyapp",
        "--image",
        f"docker-daemon:{APP_TAG}",
        "--start",
        "--ready-port",
        str(APP_PORT),
        "--memory",
        "256",
    )
    assert made["status"] == "ready" and made["tag"] == "pyapp", made
    kids = cli(daemon, "fork", "--tag", "pyapp", "-n", "3")
    ids = [kid["id"] for kid in kids]
    assert len(ids) == 3
    auth = {"Authorization": f"Bearer {daemon.token}"}
    try:
        pids = set()
        for sid in ids:
            inside = ctl.exec_command(
                sid, ["python3", "-c", FETCH, f"http://127.0.0.1:{APP_PORT}/"]
            )
            assert inside["exit_code"] == 0, inside
            seen = json.loads(inside["stdout"])
            # The app came up in the template, as the image's user, in its WORKDIR, with its ENV.
            assert seen["user"] == "web" and seen["cwd"] == "/srv/app", seen
            assert seen["greeting"] == "hello from the app image", seen
            pids.add(seen["pid"])
            # Through the daemon's port route too, as a browser or client outside reaches it.
            outside = httpx.get(ctl.port_url(sid, APP_PORT, "/"), headers=auth, timeout=30)
            assert outside.status_code == 200 and outside.json() == seen, outside.text
            # exec's defaults are the image's too.
            who = ctl.exec_command(sid, ["sh", "-c", 'id -un; pwd; echo "$GREETING $APP_HOME"'])
            assert who["stdout"].splitlines() == [
                "web",
                "/srv/app",
                "hello from the app image /srv/app",
            ], who
        assert len(pids) == 1, pids  # one process, started once before the snapshot

        # Each fork's state is its own: the service's memory and the files it writes.
        a, b, c = ids
        for _ in range(3):
            httpx.get(ctl.port_url(a, APP_PORT, "/hit"), headers=auth, timeout=30)
        hits = [
            httpx.get(ctl.port_url(sid, APP_PORT, "/hit"), headers=auth, timeout=30).json()
            for sid in ids
        ]
        assert hits == [{"hits": 4}, {"hits": 1}, {"hits": 1}], hits
        wrote = ctl.exec_command(b, ["sh", "-c", "echo only in b > data/note.txt"])
        assert wrote["exit_code"] == 0, wrote  # as web, in a directory web owns
        assert ctl.read_file(b, "/srv/app/data/note.txt") == b"only in b\n"
        for sid in (a, c):
            gone = ctl.exec_command(sid, ["ls", "-A", "/srv/app/data"])
            assert gone["stdout"] == "", (sid, gone)
    finally:
        for sid in ids:
            ctl.kill_sandbox(sid)
        ctl.delete_snapshot("pyapp")


def test_the_postgres_image_recipe(docker: DockerDaemon, daemon: Daemon) -> None:
    ref = f"docker-daemon:{docker.base_image('forkd-test/postgres:15')}"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "postgres-image" / "demo.py"), ref],
        cwd=ROOT,
        env={**daemon.env(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.count("sees its own row only") == 3
    assert "the fixture snapshot still has the original fixture" in out
    assert "FAIL" not in out
