"""Where a container image comes from, through a real daemon: one image built by a real
Docker Engine and imported by every kind of reference (a real registry it was pushed to
with ``docker push``, ``docker-daemon:``, ``docker-archive:`` from ``docker save``,
``oci-archive:`` and ``oci:``) is one image with one id, fetched once; a template made
from the registry's copy serves from its forks; and a second image on the same base
fetches only its own layer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.client import Controller
from tests import docker_daemon, oci_images
from tests.docker_daemon import DockerDaemon
from tests.integration.conftest import Daemon
from tests.integration.image_env import build, image_daemon, image_id, registry_manifest
from tests.registry_server import RegistryServer

pytestmark = pytest.mark.integration

KINDS_TAG = "forkd-test/kinds:1"
KINDS_DOCKERFILE = """\
FROM forkd-test/busybox:1
COPY index.html /srv/www/index.html
WORKDIR /srv/www
EXPOSE 8080
CMD ["httpd", "-f", "-p", "8080", "-h", "/srv/www"]
"""


@pytest.fixture(scope="module")
def docker() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    server = RegistryServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def archive_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archives")


@pytest.fixture(scope="module")
def daemon(docker: DockerDaemon, registry: RegistryServer, archive_dir: Path) -> Iterator[Daemon]:
    with image_daemon(docker, [registry.address], archive_dir) as d:
        yield d


@pytest.fixture(scope="module")
def ctl(daemon: Daemon) -> Iterator[Controller]:
    with Controller(daemon.url, token=daemon.token, timeout=900) as c:
        yield c


def push(docker: DockerDaemon, tag: str, ref: str) -> None:
    """``docker push`` of ``tag`` as ``ref`` (the engine speaks plain HTTP to loopback)."""
    docker.check("tag", tag, ref)
    docker.check("push", ref)


def test_every_reference_kind_imports_one_image_once(
    docker: DockerDaemon, ctl: Controller, registry: RegistryServer, archive_dir: Path
) -> None:
    page = f"served from every kind of reference ({os.urandom(8).hex()})\n"  # a new image
    tag = build(docker, KINDS_TAG, {"Dockerfile": KINDS_DOCKERFILE, "index.html": page})
    want_id = image_id(docker, tag)
    saved = archive_dir / "saved.tar"
    docker.check("save", "--output", str(saved), tag)
    oci = oci_images.from_docker_save(saved)  # as skopeo would copy it, without skopeo
    oci_images.write_oci_archive(archive_dir / "oci.tar", {"1": oci})
    oci_images.write_oci_layout(archive_dir / "layout", {"1": oci})
    pushed = registry.ref("kinds/web", "1")
    push(docker, tag, pushed)
    refs = [
        f"docker-daemon:{tag}",
        f"docker-archive:{saved}",
        f"oci-archive:{archive_dir / 'oci.tar'}:1",
        f"oci:{archive_dir / 'layout'}:1",
        pushed,
    ]
    done = {ref: ctl.import_image(ref) for ref in refs}
    for ref, info in done.items():
        kind = "registry" if ref == pushed else ref.partition(":")[0]
        print(
            f"{kind:15} "
            f"fetched {info['bytes_fetched']:>9} B, reused {info['bytes_reused']:>9} B, "
            f"{info['import_secs']} s"
        )
    for ref, info in done.items():
        assert info["id"] == want_id, (ref, info)  # the Docker Engine's image id
        assert info["kind"] == "container" and info["config"]["exposed_ports"] == ["8080/tcp"]
    assert len({(i["name"], i["key"]) for i in done.values()}) == 1, done  # built once
    layer_bytes = sum(len(layer.tar) for layer in oci.layers)
    first = done[refs[0]]  # its new layer fetched (the base may be held from an earlier run)
    assert first["bytes_fetched"] >= len(oci.layers[-1].tar), first
    assert first["bytes_fetched"] + first["bytes_reused"] >= layer_bytes, first
    for ref in refs[1:4]:  # the same plain layers, whichever kind names them: read once
        assert done[ref]["bytes_reused"] >= layer_bytes, (ref, done[ref])
        assert done[ref]["bytes_fetched"] < 10_000, (ref, done[ref])
    assert done[pushed]["bytes_reused"] > 0, done[pushed]  # its config; its layers are gzip
    listed = ctl.image_info(first["name"])
    assert len(listed["references"]) == len(refs), listed["references"]

    # The registry's copy is a template like any other: its service warm in each fork.
    made = ctl.create_snapshot(
        "from-registry", image=pushed, start=True, ready_port=8080, memory_mib=256
    )
    assert made["status"] == "ready"
    kids = ctl.spawn_sandboxes("from-registry", n=2)
    try:
        for kid in kids:
            served = ctl.exec_command(kid["id"], ["wget", "-qO-", "http://127.0.0.1:8080/"])
            assert served["stdout"] == page, served
    finally:
        for kid in kids:
            ctl.kill_sandbox(kid["id"])
        ctl.delete_snapshot("from-registry")


def test_a_second_image_on_a_shared_base_fetches_only_its_own_layer(
    docker: DockerDaemon, ctl: Controller, registry: RegistryServer
) -> None:
    pushed = {}
    for name in ("first", "second"):
        tag = build(
            docker,
            f"forkd-test/shared-{name}:1",
            {
                "Dockerfile": f"FROM forkd-test/busybox:1\nCOPY {name}.bin /srv/{name}.bin\n",
                f"{name}.bin": os.urandom(300_000),  # does not compress: its layer is ~300 KB
            },
        )
        pushed[name] = registry.ref(f"shared/{name}", "1")
        push(docker, tag, pushed[name])
    manifests = {n: registry_manifest(registry.address, f"shared/{n}", "1") for n in pushed}
    base = [layer["digest"] for layer in manifests["first"][0]["layers"][:-1]]
    assert [layer["digest"] for layer in manifests["second"][0]["layers"][:-1]] == base

    first = ctl.import_image(pushed["first"])
    own = manifests["first"][0]["layers"][-1]["size"]
    assert first["bytes_fetched"] >= own > 300_000, first
    second = ctl.import_image(pushed["second"])
    print(
        f"second image on the base: fetched {second['bytes_fetched']} B "
        f"(its layer {manifests['second'][0]['layers'][-1]['size']} B), "
        f"reused {second['bytes_reused']} B, {second['import_secs']} s"
    )
    m, body = manifests["second"]
    # The manifest, the config and the one layer the first image does not have: nothing more.
    assert second["bytes_fetched"] == body + m["config"]["size"] + m["layers"][-1]["size"], (
        second,
        m,
    )
    assert second["bytes_reused"] == sum(layer["size"] for layer in m["layers"][:-1]), second
    base_bytes = second["bytes_reused"]
    listed = {i["name"]: i for i in ctl.list_images()}
    for info in (first, second):
        assert listed[info["name"]]["shared_layer_bytes"] >= base_bytes, listed[info["name"]]
