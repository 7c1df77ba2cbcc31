"""The guest agent's manifest of an overlay's upper layer (forkd_fsdiff.py), on a real
overlay the test mounts: files written, removed (whiteouts), a directory removed and
made again (opaque), a link; read through the agent's op and transfer, then compared
with the image by the daemon's comparison. Every test on an overlay runs twice: listed
by GNU find (forkd_fsfind.py, the ``records`` format) and by the agent's own walk
(busybox images, the ``lines`` format)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.controller.services.manifests import (
    Manifest,
    compare,
    one_sided,
    reader_for,
    stat_of,
)
from tests.unit.test_agent_files import _load  # the agent's modules, as the guest has them

fsdiff: Any = _load("forkd_fsdiff_under_test", "forkd_fsdiff.py")  # LAYERS is set below
LISTERS = ("find", "walk")
FIND_ONLY = pytest.mark.parametrize("lister", ["find"], indirect=True)  # compares, or about find


@pytest.fixture(params=LISTERS)
def lister(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which lister the agent uses: GNU find, or its own walk (as where find is busybox's)."""
    if request.param == "walk":
        monkeypatch.setattr(sys.modules["forkd_fsfind"], "gnu_find", lambda: None)
    elif sys.modules["forkd_fsfind"].gnu_find() is None:
        pytest.skip("this host has no GNU find")
    return str(request.param)


@pytest.fixture
def overlay(tmp_path: Path, lister: str) -> Iterator[tuple[Path, Path, Path]]:
    """(merged, upper, lower): an image with /a, /d/{x,y}, /gone, /tree/z mounted under
    an overlay, as initramfs-init mounts the guest's root."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower / "d", lower / "tree", upper, work, merged):
        d.mkdir(parents=True)
    for name in ("a", "d/x", "d/y", "gone", "tree/z"):
        (lower / name).write_text(f"image {name}\n")
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mounted = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"this host cannot mount an overlay (root and overlayfs needed): "
            f"{mounted.stderr.strip()}"
        )
    try:
        yield merged, upper, lower
    finally:
        subprocess.run(["umount", str(merged)], check=True)


def _manifest(upper: Path, lower: Path, path: str, limit: int = 1000) -> Manifest:
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    opened = fsdiff.op_fs_manifest_open({"path": path, "max_entries": limit})
    assert opened["lower"] == str(lower)
    reader = reader_for(opened["format"], path, limit)
    files = sys.modules["forkd_files"]
    while True:
        with files.TRANSFERS.use(opened["transfer_id"]) as transfer:
            data, eof = transfer.read(1 << 16)
        reader.feed(data)
        if eof:
            break
    return reader.manifest()


def _changes(manifest: Manifest) -> list[tuple[str, str, str]]:
    """Against the image as it is (nothing in its upper layer); what the image holds at
    each path asked of the agent as the daemon asks it."""
    image = Manifest(manifest.path, {})
    paths = one_sided(image, manifest)
    stats = fsdiff.op_fs_lower_stat({"paths": paths})["stats"]
    below = {p: None if s is None else stat_of(s) for p, s in zip(paths, stats, strict=True)}
    return [(d.path, d.change, d.kind) for d in compare(image, manifest, below)]


def test_what_a_sandbox_did_to_its_image(overlay: tuple[Path, Path, Path]) -> None:
    merged, upper, lower = overlay
    (merged / "a").write_text("rewritten\n")
    (merged / "gone").unlink()
    subprocess.run(["rm", "-rf", str(merged / "tree")], check=True)
    subprocess.run(["rm", "-rf", str(merged / "d")], check=True)
    (merged / "d").mkdir()  # made again: opaque, the image's d/x and d/y hidden
    (merged / "d" / "new").write_text("new\n")
    (merged / "n").write_text("added\n")
    os.symlink("a", merged / "s")
    manifest = _manifest(upper, lower, "/")
    assert _changes(manifest) == [
        ("/a", "modified", "file"),
        ("/d/new", "added", "file"),
        ("/d/x", "removed", "file"),
        ("/d/y", "removed", "file"),
        ("/gone", "removed", "file"),
        ("/n", "added", "file"),
        ("/s", "added", "symlink"),
        ("/tree", "removed", "dir"),
    ]
    link = manifest.entries["/s"]
    assert (link.kind, link.target, link.size) == ("l", "a", 1)


def test_a_path_below_a_removed_directory_is_gone(overlay: tuple[Path, Path, Path]) -> None:
    merged, upper, lower = overlay
    subprocess.run(["rm", "-rf", str(merged / "tree")], check=True)
    assert _changes(_manifest(upper, lower, "/tree/z")) == [("/tree/z", "removed", "file")]
    assert _changes(_manifest(upper, lower, "/d")) == []  # untouched: nothing to walk


def test_an_unchanged_copy_up_is_no_change(overlay: tuple[Path, Path, Path]) -> None:
    merged, upper, lower = overlay
    os.chmod(merged / "a", 0o644)  # copied up with the same mode and mtime
    os.chmod(merged / "a", os.stat(lower / "a").st_mode & 0o7777)
    assert (upper / "a").exists()
    assert _changes(_manifest(upper, lower, "/")) == []


def test_the_walk_stops_at_its_limit(overlay: tuple[Path, Path, Path]) -> None:
    merged, upper, lower = overlay
    for i in range(20):
        (merged / f"f{i}").write_text("x")
    manifest = _manifest(upper, lower, "/", limit=5)
    assert len(manifest.entries) == 5 and manifest.truncated


def test_a_guest_without_forkd_overlay_refuses(tmp_path: Path) -> None:
    fsdiff.LAYERS = ((str(tmp_path / "no-upper"), str(tmp_path / "no-lower")),)
    refusal = sys.modules["forkd_agent_params"].RequestError  # the one the module raises
    with pytest.raises(refusal, match="not forkd's overlay"):
        fsdiff.op_fs_manifest_open({"path": "/", "max_entries": 10})


def test_bad_parameters_are_refused(overlay: tuple[Path, Path, Path]) -> None:
    _, upper, lower = overlay
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    bad: list[dict[str, Any]] = [
        {"path": "rel", "max_entries": 1},
        {"path": "/", "max_entries": 0},
        {"path": "/"},
    ]
    for req in bad:
        with pytest.raises(ValueError):
            fsdiff.op_fs_manifest_open(req)
    for paths in ("/a", ["rel"], ["/a"] * 1001):
        with pytest.raises(ValueError):
            fsdiff.op_fs_lower_stat({"paths": paths})


def test_the_image_s_files_are_told_apart_from_the_sandbox_s(
    overlay: tuple[Path, Path, Path],
) -> None:
    _, upper, lower = overlay
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    stats = fsdiff.op_fs_lower_stat({"paths": ["/a", "/d", "/none", "/a/../d/x"]})["stats"]
    assert [s and s[0] for s in stats] == ["f", "d", None, "f"]


@FIND_ONLY
def test_find_and_the_walk_list_the_same(overlay: tuple[Path, Path, Path], lister: str) -> None:
    """Names no shell or JSON likes, a link, a fifo, a real device and a whiteout, a
    setuid mode, a time before 1970, an opaque directory: the same manifest either way."""
    merged, upper, lower = overlay
    (merged / "a").write_text("rewritten\n")
    (merged / "gone").unlink()  # a whiteout: a character device 0/0 in the upper layer
    subprocess.run(["rm", "-rf", str(merged / "d")], check=True)
    (merged / "d").mkdir()  # opaque
    (merged / "d" / "kept").write_text("k")
    odd = merged / "odd dir"
    odd.mkdir()
    (odd / "line\nbreak").write_text("x")
    (odd / "tab\tand 'quotes'").write_text("x")
    os.symlink("target with spaces\nand a newline", odd / "link")
    (odd / os.fsdecode(b"latin-\xe9")).write_text("not UTF-8")
    os.mkfifo(odd / "fifo")
    os.mknod(odd / "null", 0o620 | 0o020000, os.makedev(1, 3))  # a device, not a whiteout
    setuid = odd / "setuid"
    setuid.write_text("x")
    os.chmod(setuid, 0o4755)
    old = odd / "old"
    old.write_text("x")
    os.utime(old, ns=(0, -1_500_000_000))
    deep = merged / "tree" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("x")

    found = _manifest(upper, lower, "/")
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(sys.modules["forkd_fsfind"], "gnu_find", lambda: None)
        walked = _manifest(upper, lower, "/")
    assert found.entries == walked.entries
    assert found.entries["/gone"].kind == "-" and found.entries["/odd dir/null"].kind == "o"
    assert found.entries["/d/x"].kind == "-"  # hidden by the opaque directory
    assert found.entries["/odd dir/old"].mtime_ns == -1_500_000_000
    assert found.entries["/odd dir/setuid"].mode == 0o4755
    assert found.entries["/odd dir/link"].target == "target with spaces\nand a newline"
    assert _manifest(upper, lower, "/odd dir").entries == {
        p: e for p, e in walked.entries.items() if p.startswith("/odd dir")
    }


def test_the_agent_says_which_format_it_lists_in(
    overlay: tuple[Path, Path, Path], lister: str
) -> None:
    _, upper, lower = overlay
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    opened = fsdiff.op_fs_manifest_open({"path": "/", "max_entries": 10})
    assert opened["format"] == {"find": "records", "walk": "lines"}[lister]
    with sys.modules["forkd_files"].TRANSFERS.use(opened["transfer_id"], finish=True) as t:
        t.abort()


def _finds_of_ours() -> list[int]:
    """This process's child processes running find."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            comm, rest = (proc / "stat").read_text().split(") ", 1)
        except (OSError, ValueError):
            continue
        if comm.endswith("(find") and int(rest.split()[1]) == os.getpid():
            pids.append(int(proc.name))
    return pids


@FIND_ONLY
def test_a_download_left_halfway_stops_find(overlay: tuple[Path, Path, Path], lister: str) -> None:
    """The host gives up on a manifest (an error, a client gone): find does not go on."""
    merged, upper, lower = overlay
    for i in range(40):
        sub = merged / f"many{i}"
        sub.mkdir()
        for j in range(100):
            (sub / f"a-rather-long-file-name-{j:04d}").write_text("x")
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    opened = fsdiff.op_fs_manifest_open({"path": "/", "max_entries": 100_000})
    files = sys.modules["forkd_files"]
    with files.TRANSFERS.use(opened["transfer_id"], finish=True) as transfer:
        data, eof = transfer.read(4096)
        assert data and not eof
        assert _finds_of_ours()  # still listing: the pipe is full
        transfer.abort()
        transfer.thread.join(10)
    assert not transfer.thread.is_alive()
    assert _finds_of_ours() == []


@FIND_ONLY
def test_a_find_that_fails_fails_the_manifest(
    overlay: tuple[Path, Path, Path], lister: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an empty manifest (no change seen) when find could not list."""
    merged, upper, lower = overlay
    (merged / "new").write_text("x")
    broken = tmp_path / "find"
    broken.write_text("#!/bin/sh\necho 'find: unknown predicate' >&2\nexit 2\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys.modules["forkd_fsfind"], "gnu_find", lambda: str(broken))
    with pytest.raises(OSError, match="find exited 2: find: unknown predicate"):
        _manifest(upper, lower, "/")
