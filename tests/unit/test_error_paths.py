"""No answer names a path under the daemon's directories, and a hostile volume upload
writes nothing outside its volume: the real app under a real uvicorn."""

from __future__ import annotations

import gzip
from pathlib import Path

import httpx
import pytest

from forkd.controller import http_errors
from forkd.controller.settings import Settings
from tests.archive.hostile import archive, file, hardlink, path_max_chain, symlink
from tests.unit.conftest import Server
from tests.unit.test_volumes import needs_mkfs


def test_paths_under_the_daemons_directories_are_cut_out() -> None:
    http_errors.hide_paths_under(["/srv/forkd-state/"])
    hidden = http_errors.HIDDEN_PATH
    said = http_errors.hide_host_paths(
        "mkfs.ext4 failed: cannot open /srv/forkd-state/volumes/.v.partial-1/base.img: "
        "No space; also '/srv/forkd-state/run/x.sock', and /srv/forkd-state itself"
    )
    assert "/srv/forkd-state" not in said
    assert said.count(hidden) == 3
    assert said.startswith("mkfs.ext4 failed: cannot open " + hidden + ": No space")
    # A sibling whose name merely starts the same, and the guest's own paths, stay.
    other = "/srv/forkd-state-other/x and /work/a.txt"
    assert http_errors.hide_host_paths(other) == other


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "victim").write_text("original")
    return outside


HOSTILE_VOLUME_CONTENT = {
    "dotdot": lambda out: archive(file("../../../outside/escaped", b"evil")),
    "symlink": lambda out: archive(symlink("l", str(out)), file("l/victim", b"evil")),
    "hardlink": lambda out: archive(hardlink("h", str(out / "victim")), file("h", b"evil")),
    "path-max-chain": lambda out: archive(*path_max_chain(str(out))),
    "device": lambda out: archive(file("ok"), symlink("dev", "/dev/sda")),
}


@needs_mkfs
@pytest.mark.parametrize("case", list(HOSTILE_VOLUME_CONTENT))
def test_a_hostile_volume_upload_is_a_400_that_writes_nothing_outside(
    server: Server, settings: Settings, tmp_path: Path, case: str
) -> None:
    outside = _outside(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*") if "state" not in p.parts)
    content = HOSTILE_VOLUME_CONTENT[case](outside)
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/x-tar"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        for body in (content, gzip.compress(content)):
            r = c.post("/v1/volumes", params={"name": "data", "size": "16M"}, content=body)
            assert r.status_code == 400, r.text
            assert "refusing" in r.json()["error"], r.text
            assert str(tmp_path) not in r.text
        assert c.get("/v1/volumes").json() == []
    assert (outside / "victim").read_text() == "original"
    after = sorted(str(p) for p in tmp_path.rglob("*") if "state" not in p.parts)
    assert after == before
    assert list((settings.state_dir / "volumes").iterdir()) == []


@needs_mkfs
def test_a_host_tool_failing_on_a_volume_names_no_host_path(
    server: Server, settings: Settings, tmp_path: Path
) -> None:
    # Within the volume's size, so the extractor takes it; ext4 itself cannot fit it.
    content = archive(file("big.bin", b"\1" * (15 << 20)), file("more.bin", b"\2" * (1 << 20)))
    headers = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/x-tar"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        r = c.post("/v1/volumes", params={"name": "data", "size": "16M"}, content=content)
    assert r.status_code == 400, r.text
    assert str(tmp_path) not in r.text and str(settings.state_dir) not in r.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/sandboxes/sb-nope-0001"),
        ("DELETE", "/v1/snapshots/nope"),
        ("GET", "/v1/volumes/nope"),
        ("POST", "/v1/sandboxes/sb-nope-0001/exec"),
        ("GET", "/v1/sandboxes/sb-nope-0001/files?path=../../etc/passwd"),
    ],
)
def test_unknown_things_are_named_not_located(
    server: Server, tmp_path: Path, method: str, path: str
) -> None:
    headers = {"Authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        r = c.request(method, path, json={"cmd": ["true"]} if method == "POST" else None)
    assert 400 <= r.status_code < 500, r.text
    assert str(tmp_path) not in r.text
