"""Issue 36, items 2 and 3: the name a user built, loaded or imported an image with finds
it (as ``docker run`` finds a local image before it pulls), in a snapshot's ``image``,
a GET and a DELETE; ``image ls`` shows it; a typo of a local name says which local name
is close; removing a tag of an image that has others only takes the tag off; and the
CLI lists and removes images through the daemon, never touching the cache itself.

The daemon is the unit tests' (fake VMs); its imports are the fake importer's, its
loads the daemon's own (real archives, really flattened)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from forkd import cli, paths
from forkd.client import Controller
from tests import oci_images as oi
from tests.unit.conftest import RecordingTransport, Server
from tests.unit.fake_images import stand_in_boot_parts

APP = oi.image([oi.layer({"app": b"v1\n"})], {"Cmd": ["app"]})


def _load(client: TestClient, tmp_path: Path, tag: str, img: oi.Image = APP) -> dict:
    archive = oi.write_oci_archive(tmp_path / f"{tag.replace(':', '_')}.tar", {"1": img})
    r = client.post(
        "/v1/images/load",
        params={"tag": tag},
        content=archive.read_bytes(),
        headers={"Content-Type": "application/x-tar"},
    )
    assert r.status_code == 201, r.text
    built = paths.images_dir() / f"{r.json()['name']}-{r.json()['key']}"
    for part in ("vmlinuz", "initrd.img"):  # the boot files stand_in_boot_parts names
        (built / part).touch()
    return r.json()


@pytest.fixture
def local(client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    stand_in_boot_parts(monkeypatch, tmp_path)
    return client


def test_an_engine_image_is_found_by_its_tag_and_listed_with_it(local: TestClient) -> None:
    r = local.post("/v1/images", json={"ref": "docker-daemon:tools:latest"})
    assert r.status_code == 201, r.text
    name = r.json()["name"]
    assert r.json()["names"] == ["tools:latest"]
    for image in ("tools", "tools:latest"):  # no registry is asked: it is local
        r = local.post(
            "/v1/snapshots", json={"tag": f"t-{image.replace(':', '-')}", "image": image}
        )
        assert r.status_code == 201, r.text
        assert r.json()["image"] == name
    listed = {i["name"]: i for i in local.get("/v1/images").json()}
    assert listed[name]["names"] == ["tools:latest"]
    assert local.get("/v1/images/tools:latest").json()["name"] == name


def test_a_typo_of_a_local_name_says_which_is_close_and_asks_no_registry(
    local: TestClient, tmp_path: Path
) -> None:
    _load(local, tmp_path, "myapp:2")
    r = local.post("/v1/snapshots", json={"tag": "t", "image": "myap:2"})
    assert r.status_code == 400
    assert "no local image 'myap:2' (did you mean myapp:2?)" in r.json()["error"]
    r = local.post("/v1/snapshots", json={"tag": "t", "image": "myap"})
    assert r.status_code == 400
    assert "did you mean myapp:2?" in r.json()["error"]
    assert local.get("/v1/snapshots/t").status_code == 404  # nothing made
    r = local.delete("/v1/images/myap:2")
    assert r.status_code == 404 and "did you mean myapp:2?" in r.json()["error"]


def test_removing_a_tag_of_an_image_with_two_only_untags_it(
    local: TestClient, tmp_path: Path
) -> None:
    first = _load(local, tmp_path, "myapp:1")
    second = _load(local, tmp_path, "myapp:stable")  # the same image: one build, two names
    assert first["name"] == second["name"]
    assert sorted(local.get(f"/v1/images/{first['name']}").json()["names"]) == [
        "myapp:1",
        "myapp:stable",
    ]
    assert local.delete("/v1/images/myapp:1").status_code == 204
    left = local.get(f"/v1/images/{first['name']}")
    assert left.status_code == 200 and left.json()["names"] == ["myapp:stable"]
    assert local.get("/v1/images/myapp:1").status_code == 404
    r = local.post("/v1/snapshots", json={"tag": "uses", "image": "myapp:stable"})
    assert r.status_code == 201, r.text
    r = local.delete("/v1/images/myapp:stable")  # its last name, and a snapshot uses it
    assert r.status_code == 409 and "snapshot uses" in r.json()["error"]
    assert local.get("/v1/images/myapp:stable").status_code == 200  # nothing changed
    assert local.delete("/v1/snapshots/uses").status_code == 204
    assert local.delete("/v1/images/myapp:stable").status_code == 204
    assert local.get(f"/v1/images/{first['name']}").status_code == 404


def test_the_newest_image_built_with_a_tag_takes_it(local: TestClient, tmp_path: Path) -> None:
    old = _load(local, tmp_path, "myapp:1")
    new = _load(local, tmp_path, "myapp:1", oi.image([oi.layer({"app": b"v2\n"})], {}))
    assert old["name"] != new["name"]
    names = {i["name"]: i["names"] for i in local.get("/v1/images").json()}
    assert names[new["name"]] == ["myapp:1"] and names[old["name"]] == []
    r = local.post("/v1/snapshots", json={"tag": "t", "image": "myapp:1"})
    assert r.json()["image"] == new["name"]


def test_the_cli_lists_and_removes_through_the_daemon(
    server: Server, sent: RecordingTransport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forkd image ls`` and ``rm`` ask the daemon: GET and DELETE /v1/images."""
    stand_in_boot_parts(monkeypatch, tmp_path)
    archive = oi.write_oci_archive(tmp_path / "a.tar", {"1": APP})
    with Controller(server.url, token=server.token) as ctl:
        loaded = ctl.load_image(archive, "myapp:1")
    app = typer.Typer()
    app.command("version")(lambda: None)
    cli.add_daemon_commands(app, transport=sent)
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    listed = CliRunner().invoke(app, ["image", "ls"], env=env)
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "myapp:1" in line)
    assert f"{loaded['name']}-{loaded['key']}" in row  # whole, in a pipe: never cut
    removed = CliRunner().invoke(app, ["image", "rm", "myapp:1"], env=env)
    assert removed.exit_code == 0, removed.output
    assert [r.url.path for r in sent.requests][-1] == "/v1/images/myapp:1"
    assert [r.method for r in sent.requests][-1] == "DELETE"
    gone = CliRunner().invoke(app, ["image", "rm", "myapp:1"], env=env)
    assert gone.exit_code != 0 and "no image 'myapp:1'" in gone.output
