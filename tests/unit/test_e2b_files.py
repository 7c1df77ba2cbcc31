"""E2B's ``files`` API beyond read and write (envd's filesystem.Filesystem over Connect)
through E2B's own SDK, against forkd's E2B port with fake VMs: exists, get_info, list to
a depth, make_dir, rename, remove, and watching a directory, polled and streamed. The
fake guest plays the entry ops over its files (tests/unit/fake_entries.py); the real
ones are tested in test_agent_entries.py and test_agent_watch.py."""

from __future__ import annotations

import asyncio
import time

import e2b
import pytest
from e2b import FilesystemEventType, FileType

from tests.unit.conftest import Server


def test_entries_are_made_listed_renamed_and_removed(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    files = sbx.files
    assert files.make_dir("/work/src") is True
    assert files.make_dir("/work/src") is False  # there already: E2B's SDK says False
    files.write("/work/src/main.py", "print('hi')\n")
    files.write("/work/README", "read me\n")
    info = files.get_info("/work/src/main.py")
    assert (info.name, info.path, info.type, info.size) == (
        "main.py",
        "/work/src/main.py",
        FileType.FILE,
        12,
    )
    assert files.exists("/work/README") and not files.exists("/work/nope")
    assert [(e.name, e.type) for e in files.list("/work")] == [
        ("README", FileType.FILE),
        ("src", FileType.DIR),
    ]
    deep = [e.path for e in files.list("/work", depth=2)]
    assert deep == ["/work/README", "/work/src", "/work/src/main.py"]
    moved = files.rename("/work/src", "/work/lib")
    assert moved.path == "/work/lib" and files.read("/work/lib/main.py") == "print('hi')\n"
    files.remove("/work/lib")
    assert not files.exists("/work/lib/main.py")
    with pytest.raises(e2b.FileNotFoundException):
        files.get_info("/work/lib")
    with pytest.raises(e2b.FileNotFoundException):
        files.list("/nowhere")
    sbx.kill()


def test_a_relative_path_is_the_users_homes(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    sbx.files.write("/root/notes.txt", "n")
    assert sbx.files.get_info("notes.txt", user="root").path == "/root/notes.txt"
    sbx.kill()


def test_a_polled_watcher_sees_what_changed_and_is_removed(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    sbx.files.make_dir("/data")
    handle = sbx.files.watch_dir("/data")
    sbx.files.write("/data/a.txt", "1")
    events = handle.get_new_events()
    assert [(e.name, e.type) for e in events] == [("a.txt", FilesystemEventType.CREATE)]
    assert handle.get_new_events() == []
    handle.stop()
    with pytest.raises(e2b.SandboxException):  # stopped: the guest no longer has it
        handle.get_new_events()
    sbx.kill()


def test_a_streamed_watch_delivers_events_as_they_happen(e2b_url: str) -> None:
    async def run() -> list[tuple[str, FilesystemEventType]]:
        sbx = await e2b.AsyncSandbox.create("base")
        await sbx.files.make_dir("/data")
        seen: list[tuple[str, FilesystemEventType]] = []
        handle = await sbx.files.watch_dir(
            "/data", on_event=lambda e: seen.append((e.name, e.type))
        )
        await sbx.files.write("/data/b.txt", "2")
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await handle.stop()
        await sbx.kill()
        return seen

    assert asyncio.run(run()) == [("b.txt", FilesystemEventType.CREATE)]


def test_a_hostile_guests_answers_are_kept_in_range_and_a_bug_says_nothing(
    server: Server, e2b_url: str
) -> None:
    """NaN times, sizes past int64, names that are not UTF-8: what the guest says is
    made fit for E2B's messages, never a 500; a failure that is the daemon's own answers
    'internal' with an error id, without its words."""
    from tests.unit import port_fixtures

    sbx = e2b.Sandbox.create("base")
    vm = port_fixtures.vm(server, sbx.sandbox_id)
    hostile = {
        "name": "bad\udcff",
        "path": "/work/bad\udcff",
        "type": "file",
        "size": 1 << 70,
        "mode": -5,
        "permissions": "-rw-r--r--",
        "owner": "root",
        "group": "root",
        "mtime": float("nan"),
    }

    async def fs_stat(path: str, user: str | None = None) -> dict[str, object]:
        return hostile

    vm.fs_stat = fs_stat  # type: ignore[method-assign, assignment]
    info = sbx.files.get_info("/work/bad")
    assert (info.name, info.size, info.mode) == ("bad\ufffd", (1 << 63) - 1, 0)
    assert info.modified_time.timestamp() == 0

    async def broken(path: str, user: str | None = None) -> dict[str, object]:
        raise RuntimeError("boom in /var/lib/forkd/secret-place")

    vm.fs_stat = broken  # type: ignore[method-assign, assignment]
    with pytest.raises(e2b.SandboxException) as failed:
        sbx.files.get_info("/work/x")
    assert "internal error" in str(failed.value) and "/var/lib" not in str(failed.value)
    sbx.kill()


def test_a_gzip_upload_is_inflated_and_a_gzip_bomb_is_refused(server: Server, e2b_url: str) -> None:
    import gzip

    import httpx

    from tests.unit.e2b_port import UPLOAD_LIMIT

    sbx = e2b.Sandbox.create("base")
    data = b"compressible " * 10_000
    sbx.files.write("/work/zipped.txt", data, gzip=True)  # octet-stream, Content-Encoding
    assert sbx.files.read("/work/zipped.txt", format="bytes") == data
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token or "",
        "Content-Type": "application/octet-stream",
        "Content-Encoding": "gzip",
    }
    bomb = gzip.compress(b"\0" * (UPLOAD_LIMIT + (1 << 20)))  # small; inflates past the limit
    assert len(bomb) < 1 << 20
    refused = httpx.post(
        f"{e2b_url}/files", params={"path": "/work/bomb"}, content=bomb, headers=headers
    )
    assert refused.status_code == 400 and "inflates past" in refused.text
    assert not sbx.files.exists("/work/bomb")  # nothing of it kept
    broken = httpx.post(
        f"{e2b_url}/files", params={"path": "/work/x"}, content=b"not gzip", headers=headers
    )
    assert broken.status_code == 400 and "not gzip" in broken.text
    sbx.kill()


def test_a_relative_file_path_is_in_the_users_home_as_envd_has_it(e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    info = sbx.files.write("notes/today.txt", "in the home", user="root")
    assert info.path == "/root/notes/today.txt"
    assert sbx.files.read("/root/notes/today.txt") == "in the home"
    assert sbx.files.read("notes/today.txt", user="root") == "in the home"
    many = sbx.files.write_files(
        [{"path": "a.txt", "data": "a"}, {"path": "/tmp/b.txt", "data": "b"}], user="root"
    )
    assert [w.path for w in many] == ["/root/a.txt", "/tmp/b.txt"]
    sbx.kill()
