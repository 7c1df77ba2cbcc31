"""forkd.image_import.docker_engine: ``docker save`` over the engine's socket, against a
real dockerd (tests/docker_daemon.py) and, for the engine's failures, a fake one."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.archive.tar_format import Kind, Limits, TarReader
from forkd.errors import Invalid, NotFound, Unavailable, UpstreamError
from forkd.image_import import docker_engine
from tests import docker_daemon
from tests.docker_daemon import DockerDaemon

APP_DOCKERFILE = """\
FROM forkd-test/debian:12
ENV APP_MODE=production GREETING="hello from forkd"
WORKDIR /srv/app
COPY app.py /srv/app/app.py
RUN ["useradd", "--uid", "1234", "--home-dir", "/srv/app", "appuser"]
USER appuser
EXPOSE 8000/tcp
CMD ["python3", "/srv/app/app.py"]
"""
APP_PY = "import os\nprint(os.environ['GREETING'])\n"


@pytest.fixture(scope="session")
def dockerd() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="session")
def app_image(dockerd: DockerDaemon, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("app-context")
    (context / "Dockerfile").write_text(APP_DOCKERFILE)
    (context / "app.py").write_text(APP_PY)
    return dockerd.build(context, "forkd-test/engine-app:1")


def archive_members(path: Path) -> dict[str, bytes | None]:
    """Each member's name and, for small regular files, its content (forkd's own reader)."""
    members: dict[str, bytes | None] = {}
    with path.open("rb") as stream:
        reader = TarReader(stream.read, Limits(max_bytes=4 << 30))
        for member in reader:
            content = None
            if member.kind is Kind.FILE and member.size < 1 << 20:
                content = b"".join(piece for _, piece in reader.chunks())
            members[member.name.rstrip("/")] = content
    return members


def test_save_writes_the_images_archive_with_its_manifest_config_and_layers(
    dockerd: DockerDaemon, app_image: str, tmp_path: Path
) -> None:
    out = tmp_path / "app.tar"
    seen: list[int] = []
    docker_engine.save(app_image, out, docker_host=dockerd.host, progress=seen.append)

    members = archive_members(out)
    manifest = json.loads(members["manifest.json"] or b"")
    assert len(manifest) == 1 and manifest[0]["RepoTags"] == [app_image]
    # Debian's base, then WORKDIR (it makes the directory), COPY and RUN: a layer each.
    layers = manifest[0]["Layers"]
    assert len(layers) == 4
    assert all(layer in members for layer in layers)
    config = json.loads(members[manifest[0]["Config"]] or b"")["config"]
    assert "GREETING=hello from forkd" in config["Env"]
    assert config["WorkingDir"] == "/srv/app"
    assert config["User"] == "appuser"
    assert config["Cmd"] == ["python3", "/srv/app/app.py"]
    assert list(config["ExposedPorts"]) == ["8000/tcp"]
    assert seen == sorted(seen) and seen[-1] == out.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.tar"]  # nothing staged is left


def test_save_finds_the_engine_through_DOCKER_HOST(
    dockerd: DockerDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = dockerd.base_image("forkd-test/busybox:1")
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    docker_engine.save(image, tmp_path / "busybox.tar")
    members = archive_members(tmp_path / "busybox.tar")
    (layer,) = json.loads(members["manifest.json"] or b"")[0]["Layers"]
    assert layer in members


def test_an_unknown_image_is_not_found_naming_it_and_leaves_nothing(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    with pytest.raises(NotFound, match="forkd-test/no-such-image:1"):
        docker_engine.save(
            "forkd-test/no-such-image:1", tmp_path / "x.tar", docker_host=dockerd.host
        )
    assert list(tmp_path.iterdir()) == []


def test_an_archive_over_the_cap_is_refused_and_leaves_nothing(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    image = dockerd.base_image("forkd-test/busybox:1")
    with pytest.raises(Invalid, match="larger than the cap of 65536 bytes"):
        docker_engine.save(image, tmp_path / "x.tar", docker_host=dockerd.host, max_bytes=65536)
    assert list(tmp_path.iterdir()) == []


def test_without_docker_io_the_fixture_skips_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(docker_daemon, "_docker_cli", lambda: None)
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install docker\.io"):
        next(docker_daemon.daemon_or_skip(tmp_path / "root"))
    assert not (tmp_path / "root").exists()


def test_a_missing_socket_is_unavailable_naming_it(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    with pytest.raises(Unavailable, match=f"unix://{sock}: the socket does not exist"):
        docker_engine.save("busybox", tmp_path / "x.tar", docker_host=f"unix://{sock}")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_a_socket_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "docker.sock").write_text("not a socket")
    with pytest.raises(Unavailable, match="is not a socket"):
        docker_engine.save("busybox", tmp_path / "x.tar", docker_host=str(tmp_path / "docker.sock"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docker.sock"]


def test_a_socket_nobody_listens_on_is_an_engine_not_running(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as bound:  # bound, never listening: refused
        bound.bind(str(sock))
        with pytest.raises(Unavailable, match="not running"):
            docker_engine.save("busybox", tmp_path / "x.tar", docker_host=str(sock))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docker.sock"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_permission_denied_on_the_socket_says_so() -> None:
    # Not under tmp_path: pytest's base directory is closed to other users.
    socket_dir = Path(tempfile.mkdtemp(prefix="forkd-engine-perm-", dir="/tmp"))
    socket_dir.chmod(0o755)
    sock = socket_dir / "docker.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(sock))
        listening.listen()
        sock.chmod(0o600)  # root's, as /var/run/docker.sock is root's and the docker group's
        # Imported as root, then run as nobody: the venv and the checkout may be closed
        # to nobody (tests/other_uid.py); the client code is loaded before the drop.
        script = (
            "import os, sys\nfrom pathlib import Path\nimport httpx, httpcore\n"
            "from forkd.image_import import docker_engine\n"
            "os.setgroups([])\nos.setresgid(65534, 65534, 65534)\n"
            "os.setresuid(65534, 65534, 65534)\n"
            "try:\n"
            "    docker_engine.save('busybox', Path('/tmp/never.tar'), docker_host=sys.argv[1])\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, f"unix://{sock}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={**os.environ, "PYTHONPATH": str(Path(docker_engine.__file__).parents[2])},
        )
    shutil.rmtree(socket_dir)
    assert proc.stdout.startswith("Unavailable permission denied on the Docker Engine socket"), (
        proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("host", ["tcp://127.0.0.1:2375", "ssh://user@host", "npipe:////./pipe/x"])
def test_a_docker_host_that_is_not_a_unix_socket_is_invalid_saying_why(
    host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(Invalid, match="only through its unix socket"):
        docker_engine.save("busybox", tmp_path / "x.tar", docker_host=host)
    monkeypatch.setenv("DOCKER_HOST", host)
    with pytest.raises(Invalid, match="DOCKER_HOST"):
        docker_engine.save("busybox", tmp_path / "x.tar")
    assert list(tmp_path.iterdir()) == []


def test_the_default_socket_is_docker_host_else_var_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert docker_engine.socket_path() == Path("/var/run/docker.sock")
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/user/1000/docker.sock")
    assert docker_engine.socket_path() == Path("/run/user/1000/docker.sock")
    assert docker_engine.socket_path("/tmp/d.sock") == Path("/tmp/d.sock")
    with pytest.raises(Invalid, match="absolute"):
        docker_engine.socket_path("unix://docker.sock")


VALID_NAMES = [
    "busybox",
    "forkd-test/debian:12",
    "library/python:3.12-slim",
    "localhost/app",
    "localhost:5000/team/app:v1.2",
    "registry.example.com/a/b/c:latest",
    "[::1]:5000/app:1",
    "app@sha256:" + "a" * 64,
    "127.0.0.1:5000/app:1@sha256:" + "0" * 64,
    "sha256:" + "f" * 64,
    "a__b-c/e--f.g:TAG_1.x",
]
INVALID_NAMES = [
    "",
    "Upper/case",
    "app:1 --rm",
    "app\n",
    "app\x00",
    "-app",
    "app:",
    "app:bad:tag",
    "app:" + "t" * 129,
    "/app",
    "app//b",
    "app@sha256:short",
    "a" * 600,
    "../etc/passwd",
]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_docker_reference_names_are_accepted(name: str) -> None:
    assert docker_engine.check_image_name(name) == name


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_a_malformed_name_is_invalid_before_any_engine_is_reached(
    name: str, tmp_path: Path
) -> None:
    with pytest.raises(Invalid):
        docker_engine.save(name, tmp_path / "x.tar", docker_host=str(tmp_path / "absent.sock"))


def test_a_tag_cannot_carry_a_digest() -> None:
    with pytest.raises(Invalid, match="digest"):
        docker_engine.check_image_name("app@sha256:" + "a" * 64, allow_digest=False)


class _FakeEngine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _fake_engine(sock: Path, status: int, body: bytes, length: int | None = None) -> _FakeEngine:
    """An engine on ``sock`` answering every request with ``status`` and ``body``
    (announcing ``length`` bytes, which may be more than it sends)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

        def address_string(self) -> str:
            return "unix"

    server = _FakeEngine(str(sock), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_engine_failing_is_an_upstream_error_quoting_it(tmp_path: Path) -> None:
    server = _fake_engine(tmp_path / "e.sock", 500, b'{"message":"layer store broke"}')
    try:
        with pytest.raises(UpstreamError, match=r"HTTP 500\): layer store broke"):
            docker_engine.save("app:1", tmp_path / "x.tar", docker_host=str(tmp_path / "e.sock"))
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.sock"]


def test_an_export_broken_off_leaves_nothing(tmp_path: Path) -> None:
    server = _fake_engine(tmp_path / "e.sock", 200, b"x" * 5000, length=1 << 20)
    try:
        with pytest.raises(UpstreamError, match="broke off"):
            docker_engine.save("app:1", tmp_path / "x.tar", docker_host=str(tmp_path / "e.sock"))
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.sock"]
