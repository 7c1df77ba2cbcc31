"""Flattening in a worker process (forkd.image_import.flatten_worker): the same root as
in the daemon's process, the same errors (a hostile layer is refused with the same
message and leaves nothing), progress passed on, a worker that dies reported with its
log, and the CPU spent by the worker, not by the caller."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from forkd import import_deadline
from forkd.archive import ArchiveTooLarge, Limits, UnsafeEntry
from forkd.errors import ImageError, TimedOut
from forkd.image_import import flatten_worker
from forkd.image_import.squash import build_rootfs as in_process
from tests.archive.hostile import directory, file, symlink
from tests.unit.test_image_layers import Image, pytestmark  # noqa: F401  (tar2sqfs needed)


@pytest.fixture()
def image(tmp_path: Path) -> Image:
    return Image(tmp_path)


def test_the_worker_makes_the_root_the_daemon_would(image: Image, tmp_path: Path) -> None:
    image.layer(directory("etc"), file("etc/os", b"base"), symlink("etc/link", "os"))
    image.layer(file("etc/os", b"top"), file("bin/tool", b"#!/bin/sh\n", mode=0o755))
    said: list[str] = []
    stats = flatten_worker.build_rootfs(image.layers, image.out, image.work, progress=said.append)
    here = tmp_path / "here.sqfs"
    assert stats == in_process(image.layers, here, image.work)
    worker_listing = image.listing()
    image.out = here
    assert image.listing() == worker_listing and image.cat("/etc/os") == b"top"
    assert said[0].startswith("layer 1/2 sha256:") and said[-1].startswith("squashfs: ")


@pytest.mark.parametrize(
    ("entries", "limits", "error"),
    [
        ((file("../escape", b"x"),), None, UnsafeEntry),
        ((file("a"), file("b"), file("c")), Limits(max_entries=2), ArchiveTooLarge),
    ],
)
def test_a_hostile_layer_is_refused_as_in_the_daemon_and_leaves_nothing(
    image: Image, entries: tuple, limits: Limits | None, error: type[Exception]
) -> None:
    image.layer(*entries)
    kw: dict[str, Any] = {"limits": limits} if limits is not None else {}
    with pytest.raises(error) as here:
        in_process(image.layers, image.out, image.work, **kw)
    with pytest.raises(error) as there:
        flatten_worker.build_rootfs(image.layers, image.out, image.work, **kw)
    assert str(there.value) == str(here.value)
    assert not image.out.exists() and list(image.out_dir.iterdir()) == []


def test_a_worker_that_dies_is_an_image_error_with_its_log(
    image: Image, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image.layer(file("f"))
    dying = tmp_path / "dying"
    dying.write_text("#!/bin/sh\necho 'MemoryError: the worker ran out' >&2\nkill -9 $$\n")
    dying.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(dying))
    with pytest.raises(ImageError, match="status -9 without an answer: MemoryError: the"):
        flatten_worker.build_rootfs(image.layers, image.out, image.work)
    assert not image.out.exists()


def test_the_worker_spends_the_cpu_not_the_caller(image: Image) -> None:
    image.layer(directory("d"), *(file(f"d/{'n' * 100}{i:06d}") for i in range(15_000)))
    mine = resource.getrusage(resource.RUSAGE_SELF)
    theirs = resource.getrusage(resource.RUSAGE_CHILDREN)
    flatten_worker.build_rootfs(image.layers, image.out, image.work)
    mine_after = resource.getrusage(resource.RUSAGE_SELF)
    theirs_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent_here = mine_after.ru_utime - mine.ru_utime
    spent_there = theirs_after.ru_utime - theirs.ru_utime
    assert spent_there > 0.3 and spent_here < spent_there / 4, (spent_here, spent_there)


def test_a_worker_past_the_imports_deadline_is_stopped(image: Image) -> None:
    """Issue 35: a layer of many entries costs minutes of CPU; it is the import's time,
    held to --import-timeout like its downloads."""
    image.layer(directory("d"), *(file(f"d/{'n' * 100}{i:06d}") for i in range(40_000)))
    started = time.monotonic()
    with pytest.raises(TimedOut, match="--import-timeout"), import_deadline.import_deadline(0.5):
        flatten_worker.build_rootfs(image.layers, image.out, image.work)
    assert time.monotonic() - started < 0.5 + 2
    assert not image.out.exists()
