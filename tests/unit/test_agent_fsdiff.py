"""The guest agent's manifest of an overlay's upper layer (forkd_fsdiff.py), on a real
overlay the test mounts: files written, removed (whiteouts), a directory removed and
made again (opaque), a link; read through the agent's op and transfer, then compared
with the image by the daemon's comparison."""

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
    ManifestReader,
    compare,
    one_sided,
    stat_of,
)
from tests.unit.test_agent_files import _load  # the agent's modules, as the guest has them

fsdiff = _load("forkd_fsdiff_under_test", "forkd_fsdiff.py")


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(merged, upper, lower): an image with /a, /d/{x,y}, /gone, /tree/z mounted under
    an overlay, as initramfs-init mounts the guest's root."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower / "d", lower / "tree", upper, work, merged):
        d.mkdir(parents=True)
    for name in ("a", "d/x", "d/y", "gone", "tree/z"):
        (lower / name).write_text(f"image {name}\n")
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"this host cannot mount an overlay (root and overlayfs needed): "
                    f"{mounted.stderr.strip()}")  # fmt: skip
    try:
        yield merged, upper, lower
    finally:
        subprocess.run(["umount", str(merged)], check=True)


def _manifest(upper: Path, lower: Path, path: str, limit: int = 1000) -> Manifest:
    fsdiff.LAYERS = ((str(upper), str(lower)),)
    opened = fsdiff.op_fs_manifest_open({"path": path, "max_entries": limit})
    assert opened["lower"] == str(lower)
    reader = ManifestReader(path, limit)
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
        ("/a", "modified", "file"), ("/d/new", "added", "file"), ("/d/x", "removed", "file"),
        ("/d/y", "removed", "file"), ("/gone", "removed", "file"), ("/n", "added", "file"),
        ("/s", "added", "symlink"), ("/tree", "removed", "dir"),
    ]  # fmt: skip
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
    bad: list[dict[str, Any]] = [{"path": "rel", "max_entries": 1}, {"path": "/", "max_entries": 0},
                                 {"path": "/"}]  # fmt: skip
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
