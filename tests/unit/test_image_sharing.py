"""Issue 36, item 2: daemons sharing one image cache never delete each other's images or
blobs. A blob another process's import holds stays through a removal (and goes once that
process is gone); an image a snapshot of another daemon on the cache uses is refused
with a 409 naming it; an image another process is building is refused while it builds.
The other process is a real one (a Python child), not a thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from forkd import paths
from forkd.errors import Conflict
from forkd.guest import image_sharing
from forkd.image_import.blob_store import BlobStore
from tests import oci_images as oi
from tests.unit.fake_images import stand_in_boot_parts


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A Python process running ``code``; it says ``ready`` once it holds what it holds,
    then waits for its standard input to close."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def kill() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_blob_another_process_holds_stays_until_that_process_is_gone(
    tmp_path: Path, kill: list[subprocess.Popen[str]]
) -> None:
    store = BlobStore(tmp_path / "blobs")
    held, loose = store.put(b"held by the other import"), store.put(b"nobody's")
    other = _child(f"""
        import sys
        from forkd.image_import.blob_store import BlobStore
        with BlobStore({str(tmp_path / "blobs")!r}).held() as store:
            assert store.has({held!r})
            print("ready", flush=True)
            sys.stdin.read()
    """)
    kill.append(other)
    store.remove_unreferenced(set())  # as an image removal of another daemon does
    assert store.has(held) and not store.has(loose)
    os.kill(other.pid, signal.SIGKILL)  # it dies holding it: its hold file names a dead pid
    other.wait()
    store.remove_unreferenced(set())
    assert not store.has(held)
    assert not [n for n in os.listdir(tmp_path / "blobs" / "holds") if not n.startswith(".")]


def test_a_hold_let_go_is_forgotten(tmp_path: Path, kill: list[subprocess.Popen[str]]) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"used for a moment")
    other = _child(f"""
        import sys
        from forkd.image_import.blob_store import BlobStore
        with BlobStore({str(tmp_path / "blobs")!r}).held() as store:
            assert store.has({digest!r})
            print("ready", flush=True)
            sys.stdin.readline()
        print("let go", flush=True)
        sys.stdin.read()
    """)
    kill.append(other)
    assert other.stdin is not None and other.stdout is not None
    store.remove_unreferenced(set())
    assert store.has(digest)
    other.stdin.write("go\n")
    other.stdin.flush()
    assert other.stdout.readline().strip() == "let go"
    store.remove_unreferenced(set())  # the process lives on, its import is done
    assert not store.has(digest)


def test_an_image_another_daemons_snapshot_uses_is_refused(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_boot_parts(monkeypatch, tmp_path)
    archive = oi.write_oci_archive(tmp_path / "a.tar", {"1": oi.image([oi.layer({"a": b"1"})], {})})
    r = client.post("/v1/images/load", params={"tag": "app:1"}, content=archive.read_bytes())
    assert r.status_code == 201, r.text
    built = paths.images_dir() / f"{r.json()['name']}-{r.json()['key']}"
    other_state = tmp_path / "other-daemon"
    snap = other_state / "snapshots" / "theirs"
    snap.mkdir(parents=True)
    (snap / "snapshot.json").write_text(json.dumps({"image": {"dir": str(built)}}))
    image_sharing.record_daemon(other_state, [other_state / "snapshots", other_state / "run"])

    r = client.delete("/v1/images/app:1")
    assert r.status_code == 409 and "snapshot theirs" in r.json()["error"]
    r = client.delete(f"/v1/images/{built.name}")
    assert r.status_code == 409 and "snapshot theirs" in r.json()["error"]
    assert built.is_dir()
    (snap / "snapshot.json").unlink()
    assert client.delete("/v1/images/app:1").status_code == 204
    assert not built.exists()


def test_a_record_of_a_daemon_whose_state_is_gone_is_dropped(tmp_path: Path) -> None:
    images_dir = tmp_path / "images"
    gone, here = tmp_path / "gone", tmp_path / "here"
    gone.mkdir()
    here.mkdir()
    image_sharing.record_daemon(gone, [gone / "snapshots"], images_dir)
    image_sharing.record_daemon(here, [here / "snapshots", here / "run"], images_dir)
    assert set(image_sharing.recorded_roots(images_dir)) == {
        gone / "snapshots",
        here / "snapshots",
        here / "run",
    }
    gone.rmdir()
    assert set(image_sharing.recorded_roots(images_dir)) == {here / "snapshots", here / "run"}
    assert len(os.listdir(images_dir / image_sharing.DAEMONS)) == 1


def test_an_image_another_process_is_building_is_not_removed(
    tmp_path: Path, kill: list[subprocess.Popen[str]]
) -> None:
    images_dir = tmp_path / "images"
    other = _child(f"""
        import sys
        from pathlib import Path
        from forkd.guest import image_sharing
        with image_sharing.building("oci-abc", Path({str(images_dir)!r})):
            print("ready", flush=True)
            sys.stdin.read()
    """)
    kill.append(other)
    with (
        pytest.raises(Conflict, match="oci-abc is being imported"),
        image_sharing.removing("oci-abc", images_dir),
    ):
        pass
    with image_sharing.removing("oci-other", images_dir):  # another image: not held up
        pass
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    with image_sharing.removing("oci-abc", images_dir):  # a dead builder's claim is void
        pass
