"""The push and pull routes over the real app (fake VM driver): bad input is a clear 4xx
before any registry is asked; a registry the operator did not allow is never looked up
or contacted; what a registry answers goes back as its status alone; and a snapshot
being pushed cannot be deleted."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx2
import pytest
from anyio.from_thread import BlockingPortal
from fastapi.testclient import TestClient

from forkd import paths
from forkd.controller.models import SnapshotPull, SnapshotPush
from forkd.controller.settings import Settings
from forkd.errors import UpstreamError
from forkd.oci import artifact, pull, reference
from forkd.oci.registry import Registry, sha256
from forkd.vmm.snapshot import files as snapshot_files
from tests.registry_server import RegistryServer
from tests.unit.fakes import FakeDriver
from tests.unit.listening_registry import Answer, listening


@pytest.fixture
def base(client: TestClient) -> str:
    r = client.post("/v1/snapshots", json={"tag": "base", "memory_mib": 128})
    assert r.status_code == 201, r.text
    return "base"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"ref": "Not A Ref"}, 400, "invalid registry reference"),
        ({"ref": "registry.invalid/a@sha256:" + "a" * 64}, 400, "not to a digest"),
        ({"ref": "registry.invalid/a:b", "flatten": "yes"}, 400, "flatten"),
        ({}, 400, "ref"),
    ],
)
def test_bad_push_requests(client: TestClient, base: str, body: Any, status: int, words: str):
    r = client.post(f"/v1/snapshots/{base}/push", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_push_of_an_unknown_snapshot_is_404(client: TestClient) -> None:
    r = client.post("/v1/snapshots/nope/push", json={"ref": "registry.invalid/a:b"})
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"ref": "a b"}, "invalid registry reference"),
        ({"ref": "registry.invalid/a:b", "tag": "../etc"}, "tag"),
        ({"ref": "registry.invalid/a:b", "token": 5}, "token"),
    ],
)
def test_bad_pull_requests(client: TestClient, body: Any, words: str) -> None:
    r = client.post("/v1/snapshots/pull", json=body)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_a_pull_into_a_taken_tag_is_409_before_the_registry(
    client: TestClient, settings: Settings, base: str
) -> None:
    settings.insecure_registries = ("127.0.0.1:1",)
    r = client.post("/v1/snapshots/pull", json={"ref": "127.0.0.1:1/a:b", "tag": base})
    assert r.status_code == 409 and "already exists" in r.json()["error"]
    r = client.post("/v1/snapshots/pull", json={"ref": "127.0.0.1:1/a:b"})
    assert r.status_code == 502  # nothing listens there: said, but not how it failed
    assert r.json()["error"] == "registry 127.0.0.1:1 is unreachable over http"


def _no_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every name lookup of the process fails, and is recorded: returned."""
    looked_up: list[str] = []

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(str(host))
        raise socket.gaierror("no name is looked up in this test")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked_up


def _both(client: TestClient, tag: str, ref: str, **body: Any) -> list[httpx2.Response]:
    """A pull of ``ref`` and a push of ``tag`` to it."""
    return [
        client.post("/v1/snapshots/pull", json={"ref": ref, **body}),
        client.post(f"/v1/snapshots/{tag}/push", json={"ref": ref, **body}),
    ]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", "127.0.0.2"])
def test_a_registry_on_this_host_not_listed_is_refused_and_never_contacted(
    client: TestClient, base: str, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with listening() as srv:
        ref = f"{host}:{srv.address.rsplit(':', 1)[1]}/forkd/x:v1"
        looked_up = _no_lookups(monkeypatch)
        answers = _both(client, base, ref) + _both(client, base, ref, insecure=True)
        assert srv.accepted == 0 and looked_up == []
    for r in answers:
        assert r.status_code == 400 and "--insecure-registry" in r.json()["error"], r.text


def test_a_listed_registry_on_this_host_is_reached_over_plain_http(
    client: TestClient, settings: Settings, base: str
) -> None:
    with listening() as srv:  # answers 404 to everything
        settings.insecure_registries = (srv.address,)
        ref = f"{srv.address}/forkd/x:v1"
        assert [r.status_code for r in _both(client, base, ref)] == [404, 404]
        asked = _both(client, base, ref, insecure=True)  # asks for what is allowed: fine
        assert [r.status_code for r in asked] == [404, 404]
        assert srv.paths[0] == "GET /v2/forkd/x/manifests/v1" and srv.accepted >= 4


def test_plain_http_to_a_registry_not_listed_is_400_before_any_lookup(
    client: TestClient, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up = _no_lookups(monkeypatch)
    for r in _both(client, base, "registry.example.com/forkd/x:v1", insecure=True):
        assert r.status_code == 400, r.text
        assert "plain HTTP to registry registry.example.com is refused" in r.json()["error"]
        assert "--insecure-registry" in r.json()["error"]
    assert looked_up == []


@pytest.mark.parametrize("ref", ["0", "python:3.12", "acme/py:v2", "py@sha256:" + "a" * 64])
def test_a_short_reference_without_a_default_registry_is_400_without_a_lookup(
    client: TestClient, base: str, ref: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up = _no_lookups(monkeypatch)
    for r in _both(client, base, ref):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "names no registry host" in error and "--default-registry" in error
    assert looked_up == []


def test_a_short_reference_goes_to_the_default_registry(
    client: TestClient, settings: Settings
) -> None:
    with listening() as srv:
        settings.insecure_registries = (srv.address,)
        settings.default_registry = srv.address
        for ref in ("forkd/x:v1", "0"):
            r = client.post("/v1/snapshots/pull", json={"ref": ref})
            assert r.status_code == 404, r.text
    # Not Docker Hub: no library/ before a one-part name.
    assert srv.paths == ["GET /v2/forkd/x/manifests/v1", "GET /v2/0/manifests/latest"]


MARKER = "SECRET-4f1d7a"  # anywhere in what a registry answers; never in what the API says
_HOSTILE_BODY = json.dumps(
    {
        "errors": [
            {"code": "MANIFEST_UNKNOWN", "message": MARKER, "detail": {"x": MARKER}},
            {"code": MARKER, "message": MARKER},
        ]
    }
).encode()


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 429, 500, 502, 503])
def test_what_a_registry_answers_is_never_echoed_to_the_client(
    client: TestClient, settings: Settings, base: str, status: int
) -> None:
    answer = Answer(status, _HOSTILE_BODY, {"Content-Type": MARKER, "X-Note": MARKER}, MARKER)
    with listening(answer) as srv:
        settings.insecure_registries = (srv.address,)
        pulled, pushed = _both(client, base, f"{srv.address}/forkd/x:v1")
    for r in (pulled, pushed):
        assert r.status_code in (403, 404, 502), r.text
        assert MARKER not in r.text, r.text
    phrase = f"answered {status} {HTTPStatus(status).phrase}"
    if status == 404:  # a push's HEAD (no body) is "missing": its upload's POST is read
        assert f"{phrase} (MANIFEST_UNKNOWN) to POST blob upload" in pushed.json()["error"]
    else:  # a missing manifest is said in forkd's words; the rest by the status
        assert f"{phrase} to HEAD blob sha256:" in pushed.json()["error"], pushed.text
        assert f"{phrase} (MANIFEST_UNKNOWN) to GET manifest v1" in pulled.json()["error"]


def test_a_manifest_a_registry_sends_is_never_echoed_either(
    client: TestClient, settings: Settings
) -> None:
    body = json.dumps({"schemaVersion": 2, "config": {"mediaType": MARKER}}).encode()
    for content_type in (MARKER, "application/vnd.oci.image.manifest.v1+json"):
        with listening(Answer(200, body, {"Content-Type": content_type})) as srv:
            settings.insecure_registries = (srv.address,)
            r = client.post("/v1/snapshots/pull", json={"ref": f"{srv.address}/forkd/x:v1"})
        assert r.status_code == 502 and "not a forkd snapshot" in r.json()["error"], r.text
        assert MARKER not in r.text, r.text


def test_a_snapshot_being_pushed_cannot_be_deleted(client: TestClient, base: str) -> None:
    snaps = client.app.state.services.snapshots  # type: ignore[attr-defined]
    with snaps.reading(base):
        r = client.delete(f"/v1/snapshots/{base}")
        assert r.status_code == 409 and "being pushed" in r.json()["error"]
    assert not snaps.holds.being_read(base)
    assert client.delete(f"/v1/snapshots/{base}").status_code == 204


def _portal(client: TestClient) -> BlockingPortal:
    """The portal to the app's loop, which a client entered (``with``) holds."""
    assert client.portal is not None
    return client.portal


def _give_up_once_started(
    client: TestClient, start: Callable[[], Awaitable[Any]], started: threading.Event
) -> None:
    """Run ``start()`` on the app's loop and cancel it once its thread has started,
    as a client that goes away does."""

    async def give_up() -> None:
        task = asyncio.ensure_future(start())
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    _portal(client).call(give_up)


def _wait_until(client: TestClient, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        _portal(client).call(asyncio.sleep, 0.02)


def test_a_push_whose_request_goes_away_holds_the_snapshot_until_its_thread_ends(
    client: TestClient, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The push thread cannot be stopped; it reads the snapshot's files to its end.
    # So the hold against deletion, and its place under the transfers cap, last as
    # long as the thread, not as long as the request that started it.
    services = client.app.state.services  # type: ignore[attr-defined]
    transfer, snaps = services.transfer, services.snapshots
    started, finish = threading.Event(), threading.Event()

    def slow_push(registry: Any, *args: Any) -> Any:
        started.set()
        finish.wait(10)
        raise UpstreamError("the registry went away")

    monkeypatch.setattr(transfer, "_push_one", slow_push)

    req = SnapshotPush(ref="registry.invalid/forkd/x:v1")
    _give_up_once_started(client, lambda: transfer.push(base, req), started)
    assert snaps.holds.being_read(base) and transfer._running == 1  # the thread still reads
    r = client.delete(f"/v1/snapshots/{base}")
    assert r.status_code == 409 and "being pushed" in r.json()["error"]
    finish.set()
    _wait_until(client, lambda: not (snaps.holds.being_read(base) or transfer._running))
    assert not snaps.holds.being_read(base) and transfer._running == 0
    assert client.delete(f"/v1/snapshots/{base}").status_code == 204


def test_a_pull_whose_request_goes_away_keeps_its_tag_until_its_thread_ends(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread writing a pulled snapshot goes on after its request is gone: the tag
    # stays reserved (no second pull or create may take it meanwhile) until it ends.
    services = client.app.state.services  # type: ignore[attr-defined]
    transfer, holds = services.transfer, services.holds
    started, finish = threading.Event(), threading.Event()

    class Remote:
        config: dict[str, Any] = {}

    def slow_write(*args: Any) -> Any:
        started.set()
        finish.wait(10)
        raise UpstreamError("the registry went away")

    monkeypatch.setattr(
        "forkd.controller.services.snapshot_transfer.pull.open_remote", lambda *a: Remote()
    )
    monkeypatch.setattr(
        "forkd.controller.services.snapshot_transfer.pull_writing.plan", lambda *a: None
    )
    monkeypatch.setattr(transfer, "_pull_sync", slow_write)

    req = SnapshotPull(ref="registry.invalid/forkd/x:v1", tag="pulled")
    _give_up_once_started(client, lambda: transfer.pull(req), started)
    assert "tag pulled" in holds.held() and transfer._running == 1
    r = client.post("/v1/snapshots", json={"tag": "pulled", "memory_mib": 128})
    assert r.status_code == 409 and "being created" in r.json()["error"]
    finish.set()
    _wait_until(client, lambda: not (holds.held() or transfer._running))
    assert holds.held() == [] and transfer._running == 0


# -- a container image's template, pushed and pulled -----------------------------------


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    server = RegistryServer()
    yield server
    server.stop()


@pytest.fixture
def container_template(client: TestClient, settings: Settings, registry: RegistryServer) -> str:
    """Snapshot ``pg`` of a (fake) imported container image, pushed: its reference."""
    from tests.unit.test_image_service import importer

    client.app.state.services.images._importer = importer()  # type: ignore[attr-defined]
    settings.insecure_registries = (registry.address,)
    r = client.post("/v1/snapshots", json={"tag": "pg", "image": "reg.test/pg:16"})
    assert r.status_code == 201, r.text
    ref = registry.ref("forkd/pg", "v1")
    r = client.post("/v1/snapshots/pg/push", json={"ref": ref})
    assert r.status_code == 200, r.text
    return ref


def _pulled_machine(client: TestClient, ref: str, tag: str) -> tuple[Any, Path]:
    r = client.post("/v1/snapshots/pull", json={"ref": ref, "tag": tag})
    assert r.status_code == 201, r.text
    state = client.app.state.services.settings.state_dir  # type: ignore[attr-defined]
    files = snapshot_files.load(state / r.json()["dir"])  # a path of the daemon's state
    assert files.meta.image is not None and files.meta.image.dir is not None
    return files.machine, Path(files.meta.image.dir)


def test_a_container_template_pulled_where_its_image_is_not_brings_its_runtime_disk(
    client: TestClient,
    driver: FakeDriver,
    registry: RegistryServer,
    container_template: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ref = container_template
    with Registry(reference.parse(ref), policy=registry.policy()) as reg:
        config = pull.open_remote(reg, "v1").config
    assert config["format"] == 2 and config["image"]["files"][-1] == "runtime.sqfs"
    assert "runtime" not in config["machine"]  # no host path travels
    built = paths.images_dir() / f"oci-{'c' * 12}-{'0' * 16}"
    # Here, where the image was imported: the pull uses that build.
    machine, image_dir = _pulled_machine(client, ref, "pg-here")
    assert image_dir == built and machine.runtime == built / "runtime.sqfs"
    # Another host, as far as images go: an empty cache. The image comes along.
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "other-cache"))
    machine, image_dir = _pulled_machine(client, ref, "pg-there")
    assert image_dir.parent == paths.images_dir() and "-pulled-" in image_dir.name
    assert machine.runtime == image_dir / "runtime.sqfs"
    assert machine.runtime.read_bytes() == (built / "runtime.sqfs").read_bytes()
    listed = {i["name"]: i for i in client.get("/v1/images").json()}
    pulled = listed[f"oci-{'c' * 12}"]  # a container image, with its config, in use
    assert pulled["kind"] == "container" and pulled["id"] == "sha256:" + "c" * 64
    assert pulled["config"]["user"] == "postgres" and pulled["config"]["exposed_ports"] == [
        "5432/tcp"
    ]
    assert pulled["used_by"] == ["snapshot pg-there"]
    r = client.post("/v1/sandboxes", json={"snapshot_tag": "pg-there"})
    assert r.status_code == 201, r.text
    assert driver.vms[-1].machine.runtime == image_dir / "runtime.sqfs"  # the fork's 2nd disk
    # Pulled again: the image pulled before is used, nothing is added.
    before = sorted(p.name for p in paths.images_dir().iterdir())
    machine, again = _pulled_machine(client, ref, "pg-again")
    assert again == image_dir and sorted(p.name for p in paths.images_dir().iterdir()) == before


@pytest.mark.parametrize(
    "hostile",
    [
        {"layers": ["sha256:../../../etc/passwd"]},  # would name a file outside the blob cache
        {"config": {"env": [5]}},  # would break GET /v1/images and the agent's configure
        {"config": "nope"},
        {"built_at_unix": "yesterday"},
        {"kind": "something-else"},
    ],
)
def test_a_pulled_image_record_that_is_not_forkds_is_refused_leaving_nothing(
    client: TestClient,
    registry: RegistryServer,
    container_template: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    hostile: dict[str, Any],
) -> None:
    with Registry(reference.parse(container_template), policy=registry.policy()) as reg:
        remote = pull.open_remote(reg, "v1")
        config = dict(remote.config)
        config["image"] = {**config["image"], "meta": {**config["image"]["meta"], **hostile}}
        raw = artifact.config_bytes(config)
        reg.put_blob(raw, sha256(raw))
        manifest = dataclasses.replace(
            remote.manifest, config_digest=sha256(raw), config_size=len(raw)
        )
        reg.put_manifest(manifest.to_bytes(), "hostile")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "other-cache"))
    hostile_ref = container_template.removesuffix("v1") + "hostile"
    r = client.post("/v1/snapshots/pull", json={"ref": hostile_ref, "tag": "never"})
    assert r.status_code == 502 and "not a snapshot this forkd can use" in r.json()["error"]
    assert not (tmp_path / "other-cache" / "images").exists()
    assert [s["tag"] for s in client.get("/v1/snapshots").json()] == ["pg"]
