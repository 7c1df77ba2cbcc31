"""The guest agent's filesystem watches (forkd_watch.py), run on the host with real
inotify on tmp dirs: events named below their root, recursive watches that follow new
and moved directories, reads that wait for a first event, the bounds on events,
directories and open watches, idle expiry, closing, and bad requests."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_agent_files import Clock, _load  # the agent's modules, as the guest has

fw: Any = _load("forkd_watch_under_test", "forkd_watch.py")
RequestError: Any = __import__("forkd_agent_params").RequestError

IDLE = 60.0


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh table behind the ops, for three watches, on a clock the test moves."""
    clock = Clock()
    t = fw.WatchTable(max_watches=3, idle_secs=IDLE, clock=clock)
    t.clock = clock
    monkeypatch.setattr(fw, "WATCHES", t)
    yield t
    clock.now += 10 * IDLE
    t.sweep()


def _open(path: Path, recursive: bool = False) -> str:
    watch_id: str = fw.op_fs_watch_open({"path": str(path), "recursive": recursive})["watch_id"]
    return watch_id


def _read(watch_id: str, **more: Any) -> dict[str, Any]:
    answer: dict[str, Any] = fw.op_fs_watch_read({"watch_id": watch_id, **more})
    assert set(answer) == {"events", "overflowed"}
    return answer


def _events(watch_id: str, **more: Any) -> list[tuple[str, str]]:
    return [(e["name"], e["type"]) for e in _read(watch_id, **more)["events"]]


def _touch(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def _write(path: Path, data: bytes = b"x") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_file_changes_come_named_below_the_root(table: Any, tmp_path: Path) -> None:
    wid = _open(tmp_path)
    assert _events(wid) == []
    _write(tmp_path / "a.txt")
    os.chmod(tmp_path / "a.txt", 0o600)
    os.rename(tmp_path / "a.txt", tmp_path / "b.txt")
    os.unlink(tmp_path / "b.txt")
    (tmp_path / "d").mkdir()
    assert _events(wid) == [
        ("a.txt", "create"),
        ("a.txt", "write"),
        ("a.txt", "chmod"),
        ("a.txt", "rename"),
        ("b.txt", "create"),
        ("b.txt", "remove"),
        ("d", "create"),
    ]
    assert _read(wid) == {"events": [], "overflowed": False}


def test_the_root_itself_is_named_empty(table: Any, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    wid = _open(root)
    os.rename(root, tmp_path / "moved")
    assert _events(wid) == [("", "rename")]
    os.rmdir(tmp_path / "moved")
    assert _events(wid) == [("", "remove")]


def test_recursive_watch_follows_directories_made_after_it(table: Any, tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)  # not followed
    wid = _open(tmp_path, recursive=True)
    _touch(tmp_path / "old" / "x")
    _touch(outside / "z")
    (tmp_path / "new").mkdir()
    assert _events(wid) == [("old/x", "create"), ("new", "create")]
    _write(tmp_path / "new" / "b.txt")
    assert _events(wid) == [("new/b.txt", "create"), ("new/b.txt", "write")]
    # Made before this read watched them: found by the walk of the new directory.
    (tmp_path / "early" / "d" / "e").mkdir(parents=True)
    _touch(tmp_path / "early" / "f")
    assert _events(wid) == [
        ("early", "create"),
        ("early/d", "create"),
        ("early/f", "create"),
        ("early/d/e", "create"),
    ]
    _touch(tmp_path / "early" / "d" / "e" / "deep")
    assert _events(wid) == [("early/d/e/deep", "create")]


def test_a_subdirectory_changed_is_told_once(table: Any, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    wid = _open(tmp_path, recursive=True)
    os.chmod(tmp_path / "sub", 0o700)
    os.rmdir(tmp_path / "sub")
    # Not again from the subdirectory's own watch (IN_ATTRIB, IN_DELETE_SELF).
    assert _events(wid) == [("sub", "chmod"), ("sub", "remove")]


def test_recursive_watch_follows_moved_directories(table: Any, tmp_path: Path) -> None:
    root, away = tmp_path / "root", tmp_path / "away"
    (away / "inner").mkdir(parents=True)
    root.mkdir()
    wid = _open(root, recursive=True)
    os.rename(away, root / "came")
    assert _events(wid) == [("came", "create")]
    _touch(root / "came" / "inner" / "f")
    os.rename(root / "came", root / "renamed")
    assert _events(wid) == [
        ("came/inner/f", "create"),
        ("came", "rename"),
        ("renamed", "create"),
    ]
    _touch(root / "renamed" / "inner" / "g")
    assert _events(wid) == [("renamed/inner/g", "create")]
    os.rename(root / "renamed", away)  # out of the tree: no longer watched
    _touch(away / "inner" / "h")
    assert _events(wid) == [("renamed", "rename")]


def test_plain_watch_skips_what_subdirectories_hold(table: Any, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    wid = _open(tmp_path)
    _write(tmp_path / "sub" / "b.txt")
    (tmp_path / "sub" / "c").mkdir()
    _touch(tmp_path / "top.txt")
    assert _events(wid) == [("top.txt", "create")]


def test_a_read_returns_as_soon_as_an_event_comes(table: Any, tmp_path: Path) -> None:
    wid = _open(tmp_path)
    timer = threading.Timer(0.3, _touch, (tmp_path / "late",))
    started = time.monotonic()
    timer.start()
    try:
        events = _events(wid, wait_s=10)
    finally:
        timer.join()
    elapsed = time.monotonic() - started
    assert events == [("late", "create")]
    assert 0.25 <= elapsed < 3


def test_a_read_without_events_returns_empty_after_its_wait(table: Any, tmp_path: Path) -> None:
    wid = _open(tmp_path)
    started = time.monotonic()
    assert _read(wid, wait_s=0.2) == {"events": [], "overflowed": False}
    assert 0.19 <= time.monotonic() - started < 2


def test_events_past_max_events_stay_for_the_next_read(table: Any, tmp_path: Path) -> None:
    wid = _open(tmp_path)
    for i in range(5):
        _touch(tmp_path / f"f{i}")
    assert _events(wid, max_events=2) == [("f0", "create"), ("f1", "create")]
    assert _events(wid, max_events=2) == [("f2", "create"), ("f3", "create")]
    assert _read(wid, max_events=2) == {
        "events": [{"name": "f4", "type": "create"}],
        "overflowed": False,
    }


def test_events_past_the_pending_bound_are_dropped_and_told(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fw, "MAX_PENDING_EVENTS", 3)
    wid = _open(tmp_path)
    for i in range(5):
        _touch(tmp_path / f"f{i}")
    answer = _read(wid)
    assert [e["name"] for e in answer["events"]] == ["f0", "f1", "f2"]
    assert answer["overflowed"] is True
    assert _read(wid) == {"events": [], "overflowed": False}  # told once


def test_directories_past_the_bound_are_not_watched_and_told(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fw, "MAX_WATCHED_DIRS", 2)  # the root and one more
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    wid = _open(tmp_path, recursive=True)
    for name in ("a", "b", "c"):
        _touch(tmp_path / name / "f")
    answer = _read(wid)
    assert answer["overflowed"] is True
    assert len(answer["events"]) == 1


def test_open_watches_are_bounded(table: Any, tmp_path: Path) -> None:
    ids = [_open(tmp_path) for _ in range(3)]
    with pytest.raises(OSError) as caught:
        _open(tmp_path)
    assert caught.value.errno == errno.EMFILE
    assert fw.op_fs_watch_close({"watch_id": ids[0]}) == {"closed": True}
    ids[0] = _open(tmp_path)
    table.clock.now += IDLE + 1  # all three expired: swept by the next open
    _open(tmp_path)
    assert len(table) == 1


def test_a_watch_unread_too_long_is_closed(table: Any, tmp_path: Path) -> None:
    kept, dropped = _open(tmp_path), _open(tmp_path)
    table.clock.now += IDLE * 0.75
    _read(kept)
    table.clock.now += IDLE * 0.75
    _touch(tmp_path / "f")
    assert _events(kept) == [("f", "create")]
    with pytest.raises(LookupError, match="expired after 60 s unread"):
        _read(dropped)
    assert len(table) == 1


def test_an_unknown_watch(table: Any) -> None:
    with pytest.raises(LookupError, match="no watch 'nope'"):
        _read("nope")
    assert fw.op_fs_watch_close({"watch_id": "nope"}) == {"closed": False}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_ends_the_watch_and_its_fds(table: Any, tmp_path: Path) -> None:
    before = _fds()
    wid = _open(tmp_path, recursive=True)
    assert _fds() > before
    assert fw.op_fs_watch_close({"watch_id": wid}) == {"closed": True}
    assert _fds() == before
    assert fw.op_fs_watch_close({"watch_id": wid}) == {"closed": False}
    with pytest.raises(LookupError):
        _read(wid)


def test_close_ends_a_waiting_read_at_once(table: Any, tmp_path: Path) -> None:
    wid = _open(tmp_path)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            _read(wid, wait_s=10)
        except LookupError as exc:
            failed.append(exc)

    reader = threading.Thread(target=wait)
    started = time.monotonic()
    reader.start()
    time.sleep(0.2)
    assert fw.op_fs_watch_close({"watch_id": wid}) == {"closed": True}
    reader.join(5)
    assert not reader.is_alive() and len(failed) == 1
    assert time.monotonic() - started < 3


def test_a_waiting_read_does_not_hold_up_another_watch(table: Any, tmp_path: Path) -> None:
    waiting, other = _open(tmp_path), _open(tmp_path)
    reader = threading.Thread(target=lambda: _read(waiting, wait_s=10))
    reader.start()
    time.sleep(0.1)
    started = time.monotonic()
    _touch(tmp_path / "f")
    assert _events(other) == [("f", "create")]
    assert time.monotonic() - started < 1
    reader.join(5)  # woken by the same event
    assert not reader.is_alive()


def test_open_fails_as_the_os_does(table: Any, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _open(tmp_path / "missing")
    _touch(tmp_path / "file")
    with pytest.raises(NotADirectoryError):
        _open(tmp_path / "file")
    assert len(table) == 0


def test_without_inotify_open_says_so(
    table: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("no C library here")

    fw._inotify.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    try:
        with pytest.raises(OSError, match="no inotify in this guest") as caught:
            _open(tmp_path)
    finally:
        fw._inotify.cache_clear()
    assert caught.value.errno == errno.ENOSYS


@pytest.mark.parametrize(
    "params",
    [
        {"wait_s": 31},
        {"wait_s": -1},
        {"wait_s": "1"},
        {"wait_s": True},
        {"max_events": 0},
        {"max_events": 10_001},
        {"max_events": 1.5},
        {"watch_id": 7},
        {"watch_id": None},
    ],
)
def test_bad_read_params(table: Any, tmp_path: Path, params: dict[str, Any]) -> None:
    req = {"watch_id": _open(tmp_path), **params}
    with pytest.raises(RequestError):
        fw.op_fs_watch_read(req)


@pytest.mark.parametrize(
    "req",
    [
        {"path": "relative/dir"},
        {"path": None},
        {"path": "/tmp", "recursive": "yes"},
    ],
)
def test_bad_open_params(table: Any, req: dict[str, Any]) -> None:
    with pytest.raises(RequestError):
        fw.op_fs_watch_open(req)
    assert len(table) == 0
