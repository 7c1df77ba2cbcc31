"""The images API over the fake VM driver: an import's answer and its progress events,
the list and its users, removal refused while a snapshot needs an image, templates from a
container image (its config given to the agent, its command started and waited for), and
the references a client may not name (archives outside --image-archive-dir), and an image
refused while flattened (a hostile layer, past --max-image-mib) leaving no blob."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from forkd import paths
from forkd.controller.models import ImageImport
from forkd.controller.services import image_requests, template_start
from forkd.controller.services import images as image_service
from forkd.controller.settings import Settings
from forkd.errors import AgentError, Invalid
from forkd.guest import container_image
from forkd.guest import image as images
from forkd.image_import import references
from forkd.image_import.model import FetchedImage, ImageConfig
from forkd.oci.policy import RegistryPolicy
from tests import oci_images
from tests.unit.fakes import FakeDriver

CONFIG = ImageConfig(
    env=("PATH=/usr/bin:/bin", "PGDATA=/var/lib/pg"),
    working_dir="/srv",
    user="postgres",
    entrypoint=("sleep",),  # the fake guest's sleep: a service that stays up
    cmd=("600",),
    exposed_ports=("5432/tcp",),
)
LAYER = "sha256:" + "1" * 64


def fake_container_image(config: ImageConfig = CONFIG, ref: str = "reg.test/pg:16") -> images.Image:
    """A built container image as container_image.build leaves one (fake disk files)."""
    digest = "sha256:" + "c" * 64
    d = paths.images_dir() / f"oci-{'c' * 12}-{'0' * 16}"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.sqfs", "runtime.sqfs"):
        (d / name).write_bytes(b"fake")
    blob = paths.blobs_dir() / "sha256" / LAYER.removeprefix("sha256:")
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"x" * 1000)
    meta = {
        "name": f"oci-{'c' * 12}",
        "key": "0" * 16,
        "kind": "container",
        "reference": ref,
        "references": [ref],
        "manifest_digest": "sha256:" + "d" * 64,
        "config_digest": digest,
        "layers": [LAYER],
        "config": config.to_json(),
        "built_at_unix": 1,
    }
    (d / "image.json").write_text(json.dumps(meta))
    return images.find_image(str(d))


def importer(
    config: ImageConfig = CONFIG, calls: list[str] | None = None
) -> Callable[[ImageImport, Callable[[str], None]], image_service.Imported]:
    def run(req: ImageImport, progress: Callable[[str], None]) -> image_service.Imported:
        if calls is not None:
            calls.append(req.ref)
        progress("layer 1/1 sha256:111111111111… 0.0/0.0 MiB")
        progress("flattening the image's layers into the root disk")
        img = fake_container_image(config, req.ref)
        fetched = FetchedImage(
            req.ref,
            "sha256:" + "d" * 64,
            "sha256:" + "c" * 64,
            config,
            (),
            bytes_fetched=1234,
            bytes_reused=5678,
        )
        return image_service.Imported(img, fetched, 0.5)

    return run


@pytest.fixture
def api(client: TestClient) -> TestClient:
    client.app.state.services.images._importer = importer()  # type: ignore[attr-defined]
    return client


def test_an_import_answers_what_it_fetched_and_lists_with_the_recipes(api: TestClient) -> None:
    r = api.post("/v1/images", json={"ref": "reg.test/pg:16"})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["kind"] == "container" and info["references"] == ["reg.test/pg:16"]
    assert (info["bytes_fetched"], info["bytes_reused"]) == (1234, 5678)
    assert info["config"]["exposed_ports"] == ["5432/tcp"] and info["layer_bytes"] == 1000
    listed = {i["name"]: i for i in api.get("/v1/images").json()}
    assert listed["python"]["kind"] == "recipe"
    assert listed[info["name"]]["used_by"] == []
    assert api.get(f"/v1/images/{info['name']}").json()["id"] == "sha256:" + "c" * 64
    assert api.get("/v1/images/nope").status_code == 404


def test_an_import_streams_its_progress_then_the_image(api: TestClient) -> None:
    with api.stream(
        "POST",
        "/v1/images",
        json={"ref": "reg.test/pg:16"},
        headers={"Accept": "text/event-stream"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    events = [
        line.removeprefix("event: ") for line in body.splitlines() if line.startswith("event:")
    ]
    assert events == ["progress", "progress", "image"], body
    assert "flattening" in body and '"bytes_fetched":1234' in body


def test_a_template_from_an_image_takes_its_config_and_starts_its_command(
    api: TestClient, driver: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls: list[int] = []

    async def listening(template: Any, port: int) -> bool:
        polls.append(port)
        return len(polls) >= 2  # the second poll finds it ready

    monkeypatch.setattr(template_start, "listening", listening)
    monkeypatch.setattr(template_start, "POLL_SECS", 0.01)
    r = api.post(
        "/v1/snapshots",
        json={"tag": "pg", "image": "reg.test/pg:16", "start": True, "ready_port": 5432},
    )
    assert r.status_code == 201, r.text
    vm = driver.vms[-1]
    assert vm.image_defaults == {
        "env": {"PATH": "/usr/bin:/bin", "PGDATA": "/var/lib/pg"},
        "cwd": "/srv",
        "user": "postgres",
    }
    started = vm.processes.list()
    assert [p["cmd"] for p in started] == [["sleep", "600"]]
    assert polls == [5432, 5432]
    name = r.json()["image"]
    used = {i["name"]: i for i in api.get("/v1/images").json()}[name]["used_by"]
    assert used == ["snapshot pg"]
    assert api.delete(f"/v1/images/{name}").status_code == 409  # the snapshot needs it
    assert api.delete("/v1/snapshots/pg").status_code == 204
    assert api.delete(f"/v1/images/{name}").status_code == 204
    assert not (paths.blobs_dir() / "sha256" / LAYER.removeprefix("sha256:")).exists()


@pytest.mark.parametrize(
    ("cmd", "timeout", "said"),
    [
        (("echo", "bad", "config"), 5.0, "exited 0 before it was ready"),
        (
            ("sleep", "600"),
            0.1,
            "not ready within 0.1 s (port 5432 did not listen; "
            "ready_timeout_secs, --ready-timeout, waits longer: default 120 s)",
        ),
    ],
)
def test_a_service_that_is_not_ready_fails_the_template_with_its_reason(
    client: TestClient, cmd: tuple[str, ...], timeout: float, said: str
) -> None:
    config = ImageConfig(cmd=cmd)
    client.app.state.services.images._importer = importer(config)  # type: ignore[attr-defined]
    body = {
        "tag": "t",
        "image": "reg.test/x:1",
        "start": True,
        "ready_port": 5432,
        "ready_timeout_secs": timeout,
    }
    r = client.post("/v1/snapshots", json=body)
    assert r.status_code == 500 and said in r.json()["error"], r.text
    assert "bad config" in r.json()["error"] or cmd[0] == "sleep"  # the output comes along
    assert client.get("/v1/snapshots").json() == []


def test_start_waits_for_the_images_one_exposed_port_by_default(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, item 4: CONFIG exposes 5432 alone: --start with no --ready-port waits for
    it (the forks then answer at once, rather than 502 while the service starts)."""
    polls: list[int] = []

    async def listening(template: Any, port: int) -> bool:
        polls.append(port)
        return len(polls) >= 3

    monkeypatch.setattr(template_start, "listening", listening)
    monkeypatch.setattr(template_start, "POLL_SECS", 0.01)
    r = api.post("/v1/snapshots", json={"tag": "pg", "image": "reg.test/pg:16", "start": True})
    assert r.status_code == 201, r.text
    assert polls == [5432, 5432, 5432]
    assert "waited for port 5432 to listen (the image's one exposed port" in r.json()["start"]
    assert "start" not in api.get("/v1/snapshots/pg").json()  # the create's answer only


@pytest.mark.parametrize(
    ("exposed", "said"),
    [((), "it exposes no port"), (("80/tcp", "443/tcp", "53/udp"), "it exposes 80, 443")],
)
def test_start_with_no_port_to_wait_for_says_so_and_how_to_ask(
    client: TestClient, exposed: tuple[str, ...], said: str
) -> None:
    config = ImageConfig(cmd=("sleep", "600"), exposed_ports=exposed)
    client.app.state.services.images._importer = importer(config)  # type: ignore[attr-defined]
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "reg.test/x:1", "start": True})
    assert r.status_code == 201, r.text
    assert r.json()["start"].startswith(f"waited for nothing: {said}")
    assert "ready_port (--ready-port)" in r.json()["start"]


def test_start_needs_a_command_and_ready_needs_start(client: TestClient) -> None:
    client.app.state.services.images._importer = importer(ImageConfig())  # type: ignore[attr-defined]
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "reg.test/x:1", "start": True})
    assert r.status_code == 400 and "no Entrypoint or Cmd" in r.json()["error"]
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "python", "ready_port": 80})
    assert r.status_code == 400 and "need start" in r.json()["error"]
    assert client.get("/v1/snapshots").json() == []


def test_a_taken_tag_is_refused_before_anything_is_imported(client: TestClient) -> None:
    calls: list[str] = []
    client.app.state.services.images._importer = importer(calls=calls)  # type: ignore[attr-defined]
    assert client.post("/v1/snapshots", json={"tag": "t"}).status_code == 201
    r = client.post("/v1/snapshots", json={"tag": "t", "image": "reg.test/pg:16"})
    assert r.status_code == 409 and calls == []


POLICY = RegistryPolicy.of((), None)


def settings_of(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(state_dir=tmp_path, snapshot_root=tmp_path / "s", run_dir=tmp_path / "r", **kw)


@pytest.mark.parametrize("kind", ["docker-archive", "oci-archive", "oci"])
def test_archives_are_refused_unless_the_operator_lists_their_directory(
    kind: str, tmp_path: Path
) -> None:
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    (elsewhere / "real.tar").write_bytes(b"")
    os.symlink(elsewhere / "real.tar", allowed / "link.tar")
    closed = settings_of(tmp_path)
    opened = settings_of(tmp_path, image_archive_dirs=(allowed,))

    def check(text: str, settings: Settings) -> None:
        image_requests.check_allowed(references.parse(text, POLICY), text, settings)

    messages = set()
    for path in (elsewhere / "real.tar", tmp_path / "missing.tar"):
        with pytest.raises(Invalid) as exc:
            check(f"{kind}:{path}", closed)
        messages.add(str(exc.value))
    assert len(messages) == 1  # the same answer whether the path exists or not
    for path in (elsewhere / "real.tar", allowed / "link.tar", allowed / ".." / "elsewhere"):
        with pytest.raises(Invalid, match="--image-archive-dir"):
            check(f"{kind}:{path}", opened)
    check(f"{kind}:{allowed / 'image.tar'}", opened)


def test_docker_engine_references_can_be_switched_off(tmp_path: Path) -> None:
    off = settings_of(tmp_path, docker_host="none")
    with pytest.raises(Invalid, match="--docker-host none"):
        image_requests.check_allowed(references.parse("docker-daemon:app:1", POLICY), "", off)
    on = settings_of(tmp_path)
    image_requests.check_allowed(references.parse("docker-daemon:app:1", POLICY), "", on)


def flatten_only(tmp_path: Path) -> Callable[..., images.Image]:
    """container_image.assemble without a kernel or runtime: the layers flattened, then
    the test fails (every image it is given must be refused while flattened)."""

    def assemble(
        config_digest: str,
        config: ImageConfig,
        identity: dict,
        write_rootfs: Any,
        progress: Any = None,
    ) -> images.Image:
        (tmp_path / "work").mkdir(exist_ok=True)
        write_rootfs(tmp_path / "rootfs.sqfs", tmp_path / "work")
        raise AssertionError(f"{identity['reference']} was flattened whole")

    return assemble


def real_importer(client: TestClient) -> None:
    """The daemon's own importer (the conftest's client has a fake one): these archives
    are on loopback's host, never on the network."""
    service = client.app.state.services.images  # type: ignore[attr-defined]
    service._importer = service._import_sync


def test_an_image_refused_while_flattened_leaves_none_of_its_blobs(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_importer(client)
    monkeypatch.setattr(container_image, "assemble", flatten_only(tmp_path))
    fake_container_image()  # a built image: its layer stays
    settings.image_archive_dirs = (tmp_path,)
    climbs = oci_images.image([oci_images.layer({"../../etc/cron.d/x": b"* * * * * root id"})])
    path = oci_images.write_oci_archive(tmp_path / "climbs.tar", {"1": climbs})
    r = client.post("/v1/images", json={"ref": f"oci-archive:{path}:1"})
    assert r.status_code == 400 and "cannot be used" in r.json()["error"], r.text
    held = sorted(os.listdir(paths.blobs_dir() / "sha256"))
    assert held == [LAYER.removeprefix("sha256:")]  # not its layer, config or manifest
    assert os.listdir(paths.blobs_dir() / "tmp") == []


def test_the_operator_caps_what_an_image_expands_to(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_importer(client)
    monkeypatch.setattr(container_image, "assemble", flatten_only(tmp_path))
    settings.image_archive_dirs = (tmp_path,)
    settings.max_image_bytes = 1 << 20  # forkd serve --max-image-mib 1
    zeros = oci_images.layer({"zeros.bin": bytes(2 << 20)})  # 2 MiB in a few KiB of gzip
    assert zeros.size < 16 << 10
    path = oci_images.write_oci_archive(tmp_path / "zeros.tar", {"1": oci_images.image([zeros])})
    r = client.post("/v1/images", json={"ref": f"oci-archive:{path}:1"})
    assert r.status_code == 400 and f"more than {1 << 20} bytes" in r.json()["error"], r.text
    assert os.listdir(paths.blobs_dir() / "sha256") == []


def test_a_name_with_several_builds_shows_its_current_one(api: TestClient) -> None:
    older = fake_container_image(ref="reg.test/old:1")
    meta = json.loads((older.dir / "image.json").read_text())
    newer_dir = older.dir.with_name(f"{older.name}-{'f' * 16}")  # sorts after the older one
    newer_dir.mkdir()
    for f in older.dir.iterdir():
        (newer_dir / f.name).write_bytes(f.read_bytes())
    meta.update(key="f" * 16, references=["reg.test/new:1"], built_at_unix=2)
    (newer_dir / "image.json").write_text(json.dumps(meta))
    images.make_current(paths.images_dir(), older.name, "f" * 16)
    shown = api.get(f"/v1/images/{older.name}").json()
    assert (shown["key"], shown["references"]) == ("f" * 16, ["reg.test/new:1"])
    exact = api.get(f"/v1/images/{older.name}-{older.key}").json()
    assert exact["references"] == ["reg.test/old:1"]
    # Deleting NAME-KEY deletes that build alone.
    assert api.delete(f"/v1/images/{older.name}-{older.key}").status_code == 204
    assert not older.dir.exists() and newer_dir.is_dir()


class _SocketTables:
    """A guest's /proc/net/tcp and tcp6 as read through the agent's range reads."""

    def __init__(self, tables: dict[str, bytes]) -> None:
        self.tables = tables
        self.asked: list[int] = []

    async def read_range(self, path: str, offset: int, length: int) -> tuple[bytes, int, bool]:
        self.asked.append(length)
        data = self.tables.get(path)
        if data is None:
            raise AgentError(f"no {path}", kind="FileNotFoundError")
        return data[offset : offset + length], 0, offset + length >= len(data)


def _row(local: str, state: str = "0A") -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000\n"


def test_a_listening_socket_is_found_in_either_table_and_junk_rows_are_passed_over() -> None:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when\n"
    tcp = header + _row("00000000:ZZZZ") + _row("0100007F:1F90", "01") + "garbage\n"
    tcp6 = header + _row("00000000000000000000000000000000:1F90")
    guest = _SocketTables({"/proc/net/tcp": tcp.encode(), "/proc/net/tcp6": tcp6.encode()})
    assert asyncio.run(template_start.listening(guest, 8080))  # type: ignore[arg-type]
    assert not asyncio.run(template_start.listening(guest, 8081))  # type: ignore[arg-type]
    assert not asyncio.run(  # no tcp6 (no IPv6 in the guest): no socket there
        template_start.listening(_SocketTables({"/proc/net/tcp": tcp.encode()}), 8080)  # type: ignore[arg-type]
    )


def test_a_huge_socket_table_is_read_only_in_its_first_mebibyte() -> None:
    """Asked every half second while a template starts: a guest that fills its socket
    table must not have the daemon read and split all of it each time."""
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when\n"
    table = (header + _row("0100007F:0016", "01") * 200_000 + _row("00000000:1F90")).encode()
    guest = _SocketTables({"/proc/net/tcp": table})
    assert not asyncio.run(template_start.listening(guest, 8080))  # type: ignore[arg-type]
    assert guest.asked and max(guest.asked) <= template_start.SOCKET_TABLE_BYTES < len(table)
