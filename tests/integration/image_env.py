"""What the container-image integration tests share: a real ``forkd serve`` allowed to import
from the test Docker Engine, loopback registries and one archive directory; images built
from real Dockerfiles there; and the daemon's cache as a refused import must leave it."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from forkd import paths
from tests.docker_daemon import DockerDaemon
from tests.integration.conftest import Daemon

CLOSED = "127.0.0.1:1"  # listed with --insecure-registry: nothing listens there


@contextlib.contextmanager
def image_daemon(
    docker: DockerDaemon, registries: list[str], archive_dir: Path, *flags: str
) -> Iterator[Daemon]:
    """A daemon of its own (the suite's shares no flags with these tests): docker-daemon:
    references go to the test Docker Engine, plain HTTP to ``registries`` (and to
    :data:`CLOSED`), archives may be read under ``archive_dir``, registry credentials
    come from ``<root>/docker.json`` (none until a test writes it); then ``flags``."""
    root = Path(tempfile.mkdtemp(prefix="forkd-di-", dir="/tmp"))
    d = Daemon(root)
    listed = [arg for address in (*registries, CLOSED) for arg in ("--insecure-registry", address)]
    d.start(
        "--kill-on-exit",
        "--docker-host",
        docker.host,
        "--image-archive-dir",
        str(archive_dir),
        "--registry-auth",
        str(root / "docker.json"),
        *listed,
        *flags,
    )
    try:
        yield d
    finally:
        d.stop()
        d.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)


def build(docker: DockerDaemon, tag: str, files: dict[str, str | bytes]) -> str:
    """``docker build --network none -t TAG`` of a context holding ``files`` (a
    ``Dockerfile`` among them); returns ``tag``."""
    with tempfile.TemporaryDirectory(prefix="forkd-ctx-") as ctx:
        for name, data in files.items():
            (Path(ctx) / name).write_bytes(data.encode() if isinstance(data, str) else data)
        return docker.build(Path(ctx), tag)


def image_id(docker: DockerDaemon, tag: str) -> str:
    """The Docker Engine's id of ``tag``: its config's digest."""
    return docker.check("image", "inspect", "--format", "{{.Id}}", tag).strip()


def registry_manifest(address: str, repo: str, tag: str) -> tuple[dict, int]:
    """The manifest ``repo:tag`` has in the registry at ``address`` (plain HTTP), and
    its length in bytes."""
    accept = (
        "application/vnd.docker.distribution.manifest.v2+json,"
        "application/vnd.oci.image.manifest.v1+json"
    )
    r = httpx.get(f"http://{address}/v2/{repo}/manifests/{tag}", headers={"Accept": accept})
    r.raise_for_status()
    return dict(json.loads(r.content)), len(r.content)


@dataclass(frozen=True)
class CacheState:
    """What a refused import must not change: the built images, the blobs held, and the
    blob store's temporary files (a partial blob would lie there)."""

    images: frozenset[str]
    blobs: frozenset[str]
    temporary: frozenset[str]

    @classmethod
    def now(cls) -> CacheState:
        return cls(
            _names(paths.images_dir()),
            _names(paths.blobs_dir() / "sha256"),
            _names(paths.blobs_dir() / "tmp"),
        )


def _names(directory: Path) -> frozenset[str]:
    try:
        return frozenset(p.name for p in directory.iterdir())
    except FileNotFoundError:
        return frozenset()
