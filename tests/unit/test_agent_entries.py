"""The guest agent's entry ops (forkd_entries.py), run on the host against tmp dirs: an
entry as E2B's envd describes one (symlinks described, never followed), a listing to a
depth and within its bound, mkdir with parents owned by the request's user, rename, and
relative paths resolved in the user's home."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from tests.unit.test_agent_files import _load  # the agent's modules, as the guest has

fe = _load("forkd_entries_under_test", "forkd_entries.py")
params = importlib.import_module("forkd_agent_params")  # the one forkd_entries raises from


def test_a_file_a_directory_and_a_symlink_are_described_as_envd_does(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "a.txt").chmod(0o640)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("dir")
    got = fe.op_fs_stat({"path": str(tmp_path / "a.txt")})
    assert {k: got[k] for k in ("name", "type", "size", "mode", "permissions")} == {
        "name": "a.txt",
        "type": "file",
        "size": 3,
        "mode": 0o640,
        "permissions": "-rw-r-----",
    }
    assert got["owner"] == "root" and got["group"] == "root"  # names, from /etc/passwd
    assert fe.op_fs_stat({"path": str(tmp_path / "dir")})["type"] == "dir"
    link = fe.op_fs_stat({"path": str(tmp_path / "link")})
    assert link["type"] == "symlink" and link["symlink_target"] == str(tmp_path / "dir")
    with pytest.raises(FileNotFoundError):
        fe.op_fs_stat({"path": str(tmp_path / "nope")})


def test_a_listing_goes_to_its_depth_and_never_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "top.txt").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path)

    def paths(depth: int) -> list[str]:
        answer = fe.op_fs_list({"path": str(tmp_path), "depth": depth})
        assert answer["truncated"] is False
        return [os.path.relpath(e["path"], tmp_path) for e in answer["entries"]]

    assert paths(1) == ["a", "loop", "top.txt"]
    assert paths(3) == ["a", "a/b", "a/b/c", "loop", "top.txt"]
    assert paths(4)[-3:] == ["a/b/c/deep.txt", "loop", "top.txt"]
    with pytest.raises(NotADirectoryError):
        fe.op_fs_list({"path": str(tmp_path / "top.txt"), "depth": 1})
    with pytest.raises(params.RequestError):
        fe.op_fs_list({"path": str(tmp_path), "depth": 0})


def test_a_listing_stops_at_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fe, "MAX_LIST_ENTRIES", 3)
    for i in range(5):
        (tmp_path / f"f{i}").write_text("")
    answer = fe.op_fs_list({"path": str(tmp_path), "depth": 1})
    assert len(answer["entries"]) == 3 and answer["truncated"] is True


def test_mkdir_makes_the_parents_for_its_user_and_says_whether_it_made_it(
    tmp_path: Path,
) -> None:
    target = tmp_path / "x" / "y"
    made = fe.op_fs_mkdir({"path": str(target), "user": "nobody"})
    assert made["created"] is True and made["entry"]["type"] == "dir"
    nobody = fe.forkd_identity.resolve("nobody")
    for path in (tmp_path / "x", target):
        assert (path.stat().st_uid, path.stat().st_gid) == (nobody.uid, nobody.gid)
    assert tmp_path.stat().st_uid == 0  # what was there is left as it was
    assert fe.op_fs_mkdir({"path": str(target)})["created"] is False
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError):
        fe.op_fs_mkdir({"path": str(tmp_path / "file")})


def test_move_renames_and_answers_the_new_entry(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "f").write_text("1")
    moved = fe.op_fs_move({"source": str(tmp_path / "old"), "destination": str(tmp_path / "new")})
    assert moved["path"] == str(tmp_path / "new") and (tmp_path / "new" / "f").read_text() == "1"
    with pytest.raises(FileNotFoundError):
        fe.op_fs_move({"source": str(tmp_path / "old"), "destination": str(tmp_path / "x")})
    with pytest.raises(params.RequestError):
        fe.op_fs_move({"source": "/", "destination": str(tmp_path / "root")})


def test_a_relative_path_is_in_the_users_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes").write_text("n")
    who = fe.forkd_identity.Identity(0, 0, (0,), str(home))
    monkeypatch.setattr(fe.command, "identity", lambda req: who)
    assert fe.op_fs_stat({"path": "notes"})["path"] == str(home / "notes")
    assert fe.op_fs_stat({"path": "../home/notes"})["path"] == str(home / "notes")
    with pytest.raises(params.RequestError):
        fe.op_fs_stat({"path": ""})


def test_a_listing_stops_at_its_size_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fe, "MAX_FS_LIST_BYTES", 1000)
    for i in range(20):
        (tmp_path / f"file-{i:02d}").write_text("")
    answer = fe.op_fs_list({"path": str(tmp_path), "depth": 1})
    assert 1 <= len(answer["entries"]) < 20 and answer["truncated"] is True
