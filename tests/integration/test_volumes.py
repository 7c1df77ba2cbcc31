"""Volumes that fork and branch copy-on-write, through the HTTP API with real VMs."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration


def _api(d: Daemon) -> httpx.Client:
    return httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=300)


def _sh(c: httpx.Client, sid: str, cmd: str) -> dict[str, Any]:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"args": ["/bin/sh", "-c", cmd]})
    assert r.status_code == 200, r.text
    return r.json()


def _fork(c: httpx.Client, tag: str, n: int = 1) -> list[dict[str, Any]]:
    r = c.post("/v1/sandboxes", json={"snapshot_tag": tag, "n": n})
    assert r.status_code == 201, r.text
    return r.json()


def _top_layer_bytes(d: Daemon, sid: str, volume: str) -> int:
    meta = json.loads((d.state_dir / "run" / sid / "vm.json").read_text())
    (att,) = [v for v in meta["volumes"] if v["name"] == volume]
    return Path(att["chain"][0]).stat().st_blocks * 512


def test_volumes_fork_and_branch_copy_on_write(daemon: Daemon) -> None:
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        data = b"reference data\n"
        info = tarfile.TarInfo("ref/readme.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    with _api(daemon) as c:
        r = c.post("/v1/volumes", params={"name": "work", "size": "1G"})
        assert r.status_code == 201, r.text
        assert r.json()["size_bytes"] == 1 << 30
        r = c.post("/v1/volumes", params={"name": "ref", "size": "64M"}, content=tar.getvalue())
        assert r.status_code == 201, r.text
        assert c.post("/v1/volumes", params={"name": "work"}).status_code == 409
        assert c.post("/v1/volumes", params={"name": "../x"}).status_code == 400

        r = c.post(
            "/v1/snapshots",
            json={
                # 512 MiB: writing 200 MiB through the page cache of a 256 MiB guest
                # leaves it in memory reclaim at the snapshot, and every child slow.
                "tag": "vol-tpl",
                "memory_mib": 512,
                "volumes": [
                    {"name": "work", "path": "/mnt/work"},
                    {"name": "ref", "path": "/mnt/ref", "readonly": True},
                ],
                "setup": [
                    "echo from-template > /mnt/work/t.txt",
                    "head -c 200M /dev/urandom > /mnt/work/big.bin",
                    "sync",
                    "echo 3 > /proc/sys/vm/drop_caches",
                ],
            },
        )
        assert r.status_code == 201, r.text
        assert c.get("/v1/snapshots/vol-tpl/info").json()["bootable"]

        kids = _fork(c, "vol-tpl", 3)
        ids = [k["id"] for k in kids]
        for sid in ids:
            assert _sh(c, sid, "cat /mnt/work/t.txt")["stdout"] == "from-template\n"
            assert _sh(c, sid, "cat /mnt/ref/ref/readme.txt")["stdout"] == "reference data\n"
            assert _sh(c, sid, "stat -c %s /mnt/work/big.bin")["stdout"] == f"{200 << 20}\n"
            # The 200 MiB file is the template's: a child's own layer stays tiny.
            assert _top_layer_bytes(daemon, sid, "work") < 8 << 20
        assert _sh(c, ids[0], "touch /mnt/ref/x")["exit_code"] != 0  # read-only

        _sh(c, ids[0], "echo child-0 > /mnt/work/mine.txt && sync")
        for sid in ids[1:]:
            assert _sh(c, sid, "cat /mnt/work/mine.txt")["exit_code"] != 0
        (fresh,) = _fork(c, "vol-tpl")
        assert _sh(c, fresh["id"], "cat /mnt/work/mine.txt")["exit_code"] != 0

        # Branch the child: grandchildren see its volume as of the branch.
        branch = c.post(f"/v1/sandboxes/{ids[0]}/branch", json={"tag": "vol-br"}).json()
        _sh(c, ids[0], "echo after > /mnt/work/mine.txt && sync")
        (grand,) = _fork(c, branch["tag"])
        assert _sh(c, grand["id"], "cat /mnt/work/mine.txt")["stdout"] == "child-0\n"
        assert _sh(c, ids[0], "cat /mnt/work/mine.txt")["stdout"] == "after\n"
        meta = json.loads((Path(branch["dir"]) / "snapshot.json").read_text())
        assert [(v["name"], v["path"], v["readonly"]) for v in meta["volumes"]] == [
            ("work", "/mnt/work", False),
            ("ref", "/mnt/ref", True),
        ]

        # A volume in use cannot go; the answer names who uses it.
        r = c.delete("/v1/volumes/work")
        assert r.status_code == 409 and "vol-tpl" in r.json()["error"]
        listed = {v["name"]: v for v in c.get("/v1/volumes").json()}
        assert "snapshot vol-tpl" in listed["work"]["used_by"]

        for sid in [*ids, fresh["id"], grand["id"]]:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        for tag in ("vol-br", "vol-tpl"):
            assert c.delete(f"/v1/snapshots/{tag}").status_code == 204
        assert c.delete("/v1/volumes/work").status_code == 204
        assert c.delete("/v1/volumes/ref").status_code == 204
        assert c.get("/v1/volumes/work").status_code == 404
