"""Issue 36, item 19: the original forkd's ``--volume HOST_FILE.ext4:/mnt/data[:ro]``. The
CLI sends the file to the daemon as a volume (``POST /v1/volumes/import``, streamed),
once for the same unchanged file, says it is copy-on-write, and attaches it; the file
itself never changes. The route refuses what is not an ext4 image, or not a volume's
size, or a name taken, keeping nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from tests.unit.conftest import RecordingTransport, Server, make_app


def _ext4(path: Path, mib: int = 16) -> Path:
    with path.open("wb") as f:
        f.truncate(mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(path)], check=True)
    return path


def _leftovers(settings_state: Path) -> list[str]:
    root = settings_state / "volumes"
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.exists() else []


def test_an_ext4_image_becomes_a_volume(client: TestClient, tmp_path: Path) -> None:
    image = _ext4(tmp_path / "data.ext4")
    r = client.post("/v1/volumes/import", params={"name": "data"}, content=image.read_bytes())
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "data" and r.json()["size_bytes"] == 16 << 20
    assert client.get("/v1/volumes/data").status_code == 200
    attach = [{"name": "data", "path": "/mnt/data"}]
    r = client.post("/v1/snapshots", json={"tag": "t", "memory_mib": 128, "volumes": attach})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("body", "said"),
    [(b"\0" * (16 << 20), "not an ext4"), (b"x" * 4096, "16 MiB to 1 TiB"), (b"", "no body")],
)
def test_what_is_not_an_ext4_volume_is_refused_and_nothing_kept(
    client: TestClient, tmp_path: Path, body: bytes, said: str
) -> None:
    r = client.post("/v1/volumes/import", params={"name": "bad"}, content=body)
    assert r.status_code == 400 and said in r.json()["error"], r.text
    assert client.get("/v1/volumes/bad").status_code == 404
    state = Path(client.app.state.services.volumes.store.root).parent  # type: ignore[attr-defined]
    assert _leftovers(state) == []


def test_a_taken_name_is_a_409(client: TestClient, tmp_path: Path) -> None:
    image = _ext4(tmp_path / "data.ext4").read_bytes()
    assert client.post("/v1/volumes/import", params={"name": "d"}, content=image).status_code == 201
    r = client.post("/v1/volumes/import", params={"name": "d"}, content=image)
    assert r.status_code == 409


def test_the_originals_volume_flag_imports_the_file_once(
    server: Server, sent: RecordingTransport, tmp_path: Path
) -> None:
    image = _ext4(tmp_path / "data.ext4")
    before = hashlib.sha256(image.read_bytes()).hexdigest()
    app = make_app(sent)
    env = {"FORKD_URL": server.url, "FORKD_TOKEN_FILE": str(server.token_file)}
    res = CliRunner().invoke(
        app,
        [
            "snapshot",
            "create",
            "--tag",
            "a",
            "--memory",
            "128",
            "--volume",
            f"{image}:/mnt/data:ro",
        ],
        env=env,
    )
    assert res.exit_code == 0, res.output
    assert "copy-on-write" in res.stderr and "never changed" in res.stderr
    made = json.loads(
        next(r.content for r in reversed(sent.requests) if r.url.path == "/v1/snapshots")
    )
    [attached] = made["volumes"]
    assert attached["path"] == "/mnt/data" and attached["readonly"] is True
    assert attached["name"].startswith("data-")
    imports = [r for r in sent.requests if r.url.path == "/v1/volumes/import"]
    res = CliRunner().invoke(
        app,
        ["snapshot", "create", "--tag", "b", "--memory", "128", "--volume", f"{image}:/mnt/data"],
        env=env,
    )
    assert res.exit_code == 0, res.output
    assert "already" in res.stderr
    assert [r for r in sent.requests if r.url.path == "/v1/volumes/import"] == imports
    assert hashlib.sha256(image.read_bytes()).hexdigest() == before
    missing = f"{tmp_path}/none.ext4:/mnt/x"
    res = CliRunner().invoke(
        app, ["snapshot", "create", "--tag", "c", "--volume", missing], env=env
    )
    assert res.exit_code == 2 and "there is no file" in res.output
    assert os.path.exists(image)
