"""``POST /v1/images/load``: an image archive a client sends (``docker save``, ``podman
save``, an OCI archive), read by the daemon's own archive reader into the blob store
(only the image's disks are faked here: tests/unit/fake_images.py), named ``loaded:TAG``
and found by ``image=TAG`` before any registry; every refusal leaves nothing behind.
Through the HTTP app, and through both Python SDK clients against a real uvicorn."""

from __future__ import annotations

import asyncio
import errno
import gzip
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from forkd import cli, paths
from forkd.client import AsyncController, Controller, ControllerError, Snapshot
from forkd.controller.app import create_app
from forkd.controller.services import images as image_service
from forkd.controller.settings import Settings
from forkd.guest import container_image
from forkd.guest import image as images
from forkd.image_import.model import FetchedImage
from tests import docker_daemon, oci_images
from tests.docker_daemon import DockerDaemon
from tests.unit.conftest import TOKEN, Server
from tests.unit.fake_images import FakeImporter
from tests.unit.fakes import FakeDriver
from tests.unit.test_image_builders import install_fake

APP = oci_images.image(
    [oci_images.layer({"srv/app.py": b"print('hi')\n"}, "none")],
    {"Env": ["PATH=/bin"], "Cmd": ["sh"], "WorkingDir": "/srv"},
)
OTHER = oci_images.image([oci_images.layer({"etc/other": b"x"}, "none")], {"Cmd": ["sh"]})


@pytest.fixture(autouse=True)
def fake_disks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetched image's guest disks are faked: no kernel, runtime or squashfs here."""

    def build(fetched: FetchedImage, progress: Any = None, *_: Any, **__: Any) -> images.Image:
        return FakeImporter._built(fetched, progress or (lambda _m: None))

    monkeypatch.setattr(container_image, "build", build)


def _docker_save(tmp_path: Path, tagged: dict[str, oci_images.Image]) -> bytes:
    return oci_images.write_docker_archive(tmp_path / "saved.tar", tagged).read_bytes()


def _oci_archive(tmp_path: Path, tagged: dict[str, Any]) -> bytes:
    return oci_images.write_oci_archive(tmp_path / "oci.tar", tagged).read_bytes()


def _load(client: TestClient, body: bytes, tag: str | None = None) -> Any:
    params = {"tag": tag} if tag else {}
    return client.post("/v1/images/load", content=body, params=params)


def _left_behind() -> list[str]:
    tmp = paths.blobs_dir() / "tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []


def test_a_docker_save_archive_is_imported_and_named_by_its_tag(
    client: TestClient, tmp_path: Path
) -> None:
    r = _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1")
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["kind"] == "container" and info["references"] == ["loaded:app:1"]
    assert info["id"] == APP.config.digest
    assert info["config"]["working_dir"] == "/srv"
    assert info["bytes_fetched"] > 0 and info["bytes_reused"] == 0
    again = _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1").json()
    assert (again["bytes_fetched"], again["name"]) == (0, info["name"])  # held already
    assert _left_behind() == []  # the archive is gone once read


def test_an_oci_archive_of_one_image_is_that_image_whatever_its_name(
    client: TestClient, tmp_path: Path
) -> None:
    # Podman names its image localhost/app:1 inside; the user said app:1.
    body = _oci_archive(tmp_path, {"localhost/app:1": APP})
    r = _load(client, body, "app:1")
    assert r.status_code == 201, r.text
    assert r.json()["id"] == APP.config.digest
    assert r.json()["references"] == ["loaded:app:1"]


def test_a_tag_picks_one_image_of_several_and_is_needed_for_it(
    client: TestClient, tmp_path: Path
) -> None:
    body = _docker_save(tmp_path, {"app:1": APP, "other:2": OTHER})
    r = _load(client, body)
    assert r.status_code == 400 and "holds 2 images" in r.json()["error"], r.text
    r = _load(client, body, "other:2")
    assert r.status_code == 201 and r.json()["id"] == OTHER.config.digest, r.text
    r = _load(client, body, "nosuch:1")
    assert r.status_code == 404 and "nosuch:1" in r.json()["error"], r.text
    assert _left_behind() == []


def test_a_template_names_a_loaded_image_by_its_tag(client: TestClient, tmp_path: Path) -> None:
    importer = client.app.state.services.images._importer  # type: ignore[attr-defined]
    assert _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1").status_code == 201
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "app:1"})
    assert r.status_code == 201, r.text
    assert importer.calls == []  # found here: no registry was asked
    assert _load(client, _docker_save(tmp_path, {"web": OTHER}), "web").status_code == 201
    r = client.post("/v1/snapshots", json={"tag": "w", "image": "web:latest"})
    assert r.status_code == 201 and importer.calls == [], r.text


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"", "no body"),
        (b"not a tar archive at all" * 40, "not a tar archive"),
        (gzip.compress(b"x" * 2048, mtime=0), "gzip-compressed"),
        (oci_images.tar_of({"hello.txt": b"hi"}), "neither a docker save archive"),
    ],
    # Ids that do not depend on the bytes: two xdist workers must collect the same names.
    ids=["empty", "text", "gzip", "plain-tar"],
)
def test_what_is_not_an_image_archive_is_a_400_and_leaves_nothing(
    client: TestClient, body: bytes, said: str
) -> None:
    r = _load(client, body)
    assert r.status_code == 400 and said in r.json()["error"], r.text
    assert _left_behind() == []
    assert [i for i in client.get("/v1/images").json() if i["kind"] == "container"] == []


@pytest.mark.parametrize("tag", ["App:1", "a b", "x@sha256:" + "0" * 64, "-x", "a" * 300])
def test_a_bad_tag_is_refused_before_the_archive_is_read(
    client: TestClient, tmp_path: Path, tag: str
) -> None:
    r = _load(client, _docker_save(tmp_path, {"app:1": APP}), tag)
    assert r.status_code in (400, 422), r.text
    assert _left_behind() == []


def test_an_archive_over_the_daemons_cap_is_a_413_and_leaves_nothing(
    settings: Settings, driver: FakeDriver, tmp_path: Path
) -> None:
    settings.max_image_bytes = 64 << 10  # forkd serve --max-image-mib, in bytes
    app = create_app(settings, TOKEN, driver=driver, importer=FakeImporter())
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        big = oci_images.image([oci_images.layer({"big": os.urandom(80 << 10)}, "none")])
        body = _docker_save(tmp_path, {"big:1": big})

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(body), 8192):
                yield body[i : i + 8192]

        r = client.post("/v1/images/load", content=chunks())
        assert r.status_code == 413, r.text
        r = client.post("/v1/images/load", content=body)  # an honest length: refused at once
        assert r.status_code == 413, r.text
        assert _left_behind() == []


def test_a_load_streams_its_steps_then_the_image(client: TestClient, tmp_path: Path) -> None:
    with client.stream(
        "POST",
        "/v1/images/load",
        content=_docker_save(tmp_path, {"app:1": APP}),
        params={"tag": "app:1"},
        headers={"Accept": "text/event-stream"},
    ) as r:
        assert r.status_code == 200
        body = "".join(r.iter_text())
    assert "received the archive" in body and "event: image" in body, body
    assert body.rstrip().splitlines()[0] == "event: progress"


# ------------------------------------------------------------------ the SDK clients


def test_the_sdk_sends_a_path_or_a_file_and_hears_the_upload(
    ctl: Controller, tmp_path: Path
) -> None:
    path = oci_images.write_docker_archive(tmp_path / "app.tar", {"app:1": APP})
    steps: list[str] = []
    info = ctl.load_image(path, "app:1", on_progress=steps.append)
    assert info["references"] == ["loaded:app:1"] and info["id"] == APP.config.digest
    assert steps[0].startswith("sent ") and "MiB of the archive" in steps[0], steps
    assert any("received the archive" in s for s in steps), steps
    with path.open("rb") as f:
        assert ctl.load_image(f)["bytes_fetched"] == 0
    snap = Snapshot.create("t", controller=ctl, image="app:1")
    assert snap.tag == "t"
    with pytest.raises(ControllerError) as exc:
        ctl.load_image(io.BytesIO(b"junk" * 1000))
    assert exc.value.status == 400 and "not a tar archive" in str(exc.value)


def test_the_async_sdk_loads_alike(server: Server, tmp_path: Path) -> None:
    path = oci_images.write_oci_archive(tmp_path / "app.tar", {"app:1": APP})

    async def main() -> tuple[dict[str, Any], list[str]]:
        steps: list[str] = []

        async def hear(msg: str) -> None:
            steps.append(msg)

        async with AsyncController(server.url, token=server.token) as actl:
            return await actl.load_image(path, "app:1", on_progress=hear), steps

    info, steps = asyncio.run(main())
    assert info["id"] == APP.config.digest and info["references"] == ["loaded:app:1"]
    assert steps[0].startswith("sent ") and any("received" in s for s in steps), steps


# ------------------------------------------------------------------ the CLI


def _forkd(server: Server, *args: str, stdin: bytes | None = None) -> Any:
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    return CliRunner().invoke(cli.app, list(args), env=env, input=stdin)


def _loaded_references(ctl: Controller) -> list[str]:
    return sorted(r for i in ctl.list_images() for r in i.get("references") or [])


def test_forkd_image_load_sends_a_file_or_standard_input(
    server: Server, ctl: Controller, tmp_path: Path
) -> None:
    path = oci_images.write_docker_archive(tmp_path / "app.tar", {"app:1": APP})
    res = _forkd(server, "image", "load", str(path), "-t", "app:1")
    assert res.exit_code == 0, res.output
    assert "loaded" in res.output and "(app:1)" in res.output
    other = oci_images.write_docker_archive(tmp_path / "other.tar", {"other": OTHER})
    res = _forkd(server, "image", "load", "-", "--tag", "other", stdin=other.read_bytes())
    assert res.exit_code == 0, res.output
    assert _loaded_references(ctl) == ["loaded:app:1", "loaded:other:latest"]
    res = _forkd(server, "image", "load", str(tmp_path / "nosuch.tar"))
    assert res.exit_code != 0 and "no file" in res.output
    res = _forkd(server, "snapshot", "create", "--tag", "t", "--image", "app:1")
    assert res.exit_code == 0, res.output
    assert ctl.snapshot("t")["image"] == ctl.load_image(path, "app:1")["name"]
    assert server.importer.calls == []  # no registry was asked for app:1


@pytest.mark.parametrize("name", ["podman", "buildah"])
def test_a_daemonless_builders_image_is_sent_to_the_daemon(
    server: Server, ctl: Controller, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """forkd image build with Podman or Buildah: their export goes to the daemon over HTTP,
    so a daemon on another host (or one without --image-archive-dir) takes it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_BUILDER_LOG", str(tmp_path / "argv.log"))
    exported = oci_images.write_oci_archive(tmp_path / "export.tar", {"localhost/app:1": APP})
    monkeypatch.setenv("FAKE_BUILDER_ARCHIVE", str(exported))
    install_fake(bin_dir, name)
    exports = tmp_path / "exports"
    exports.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(exports))  # where the export is made
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM forkd-test/busybox:1\n")
    res = _forkd(server, "image", "build", "-t", "app:1", "--builder", name, str(ctx))
    assert res.exit_code == 0, res.output
    assert _loaded_references(ctl) == ["loaded:app:1"]
    assert list(exports.iterdir()) == []  # the export is removed once sent


@pytest.fixture(scope="module")
def dockerd() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


def test_a_docker_build_is_sent_when_the_daemon_cannot_read_the_engine(
    server: Server,
    ctl: Controller,
    dockerd: DockerDaemon,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--upload (and a daemon that is not on loopback): docker save here, sent there."""
    dockerd.base_image("forkd-test/busybox:1")
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    (tmp_path / "Dockerfile").write_text(
        'FROM forkd-test/busybox:1\nENV GREETING=sent\nWORKDIR /srv\nCMD ["sh"]\n'
    )
    res = _forkd(
        server,
        "image",
        "build",
        "-t",
        "forkd-test/sent:1",
        "--builder",
        "docker",
        "--network",
        "none",
        "--upload",
        str(tmp_path),
    )
    assert res.exit_code == 0, res.output
    assert "saved forkd-test/sent:1" in res.output, res.output
    [info] = [i for i in ctl.list_images() if i["kind"] == "container"]
    assert info["references"] == ["loaded:forkd-test/sent:1"]
    assert (
        info["id"]
        == dockerd.check("image", "inspect", "--format", "{{.Id}}", "forkd-test/sent:1").strip()
    )
    assert "GREETING=sent" in info["config"]["env"] and info["config"]["working_dir"] == "/srv"


def test_an_import_of_a_loaded_name_answers_the_loaded_image(
    client: TestClient, tmp_path: Path
) -> None:
    """What forkd snapshot create --image app:1 does first (POST /v1/images): no registry."""
    importer = client.app.state.services.images._importer  # type: ignore[attr-defined]
    loaded = _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1").json()
    r = client.post("/v1/images", json={"ref": "app:1"})
    assert r.status_code == 201, r.text
    assert (r.json()["name"], r.json()["bytes_fetched"]) == (loaded["name"], 0)
    assert importer.calls == []
    r = client.post("/v1/images", json={"ref": "app:2"})  # not loaded: asks as before
    assert r.status_code == 404 and importer.calls == ["app:2"], r.text


def test_archives_arriving_at_once_are_capped(client: TestClient, tmp_path: Path) -> None:
    service = client.app.state.services.images  # type: ignore[attr-defined]
    service._receiving = image_service.MAX_IMPORTS  # that many uploads under way
    r = _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1")
    assert r.status_code == 503 and "retry shortly" in r.json()["error"], r.text
    service._receiving = 0
    assert _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1").status_code == 201


def test_a_full_disk_while_an_archive_arrives_says_so_and_keeps_nothing(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def full(*_: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(image_service, "_receive", full)
    r = _load(client, _docker_save(tmp_path, {"app:1": APP}), "app:1")
    assert r.status_code == 500 and "filled up" in r.json()["error"], r.text
    assert _left_behind() == []
    service = client.app.state.services.images  # type: ignore[attr-defined]
    assert service._receiving == 0
