"""Random damage to real archives: the extractor answers with an ArchiveError or
unpacks, and never writes outside its target."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from forkd.archive import DATA, ROOTFS, ArchiveError, Limits, extract
from tests.archive.hostile import archive, directory, file, hardlink, pax_header, symlink

SEED = archive(
    directory("d"),
    file("d/a.txt", b"alpha" * 100),
    symlink("d/l", "a.txt"),
    hardlink("d/h", "d/a.txt"),
    pax_header("p" * 150, {"comment": "long", "SCHILY.xattr.user.k": "v"}),
    file("e", b""),
)
LIMITS = Limits(max_entries=50, max_bytes=1 << 20, max_header_bytes=1 << 16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.integers(0, len(SEED)),
    rootfs=st.booleans(),
)
def test_damaged_archives_are_refused_or_unpacked_never_escaping(
    edits: list[tuple[int, int]], cut: int, rootfs: bool
) -> None:
    data = bytearray(SEED)
    for pos, value in edits:
        data[pos] = value
    base = Path(tempfile.mkdtemp(prefix="forkd-fuzz-"))
    try:
        dest = base / "dest"
        dest.mkdir()
        (base / "sentinel").write_text("untouched")
        try:
            extract(io.BytesIO(bytes(data[:cut])).read, dest, ROOTFS if rootfs else DATA, LIMITS)
        except ArchiveError:
            pass
        except PermissionError:
            assert rootfs  # owners from a damaged header, as a user who is not root
        assert sorted(p.name for p in base.iterdir()) == ["dest", "sentinel"]
        assert (base / "sentinel").read_text() == "untouched"
    finally:
        shutil.rmtree(base)


_PARTS = st.sampled_from(["a", "b", "l", "..", ".", "", "outside"])
_PATHS = st.lists(_PARTS, min_size=1, max_size=5).map("/".join)
_ENTRY = st.tuples(
    st.sampled_from(["file", "dir", "symlink", "hardlink"]),
    _PATHS,
    st.one_of(_PATHS, _PATHS.map(lambda p: "/" + p)),
)


def _resolve(path: Path, hops: int = 40) -> Path | None:
    """Where ``path`` leads, following links as the kernel would; None for a loop.

    ``os.path.realpath`` is no judge here: for a loop such as ``a -> a//a`` it
    answers ``/a`` on CPython 3.11, a path outside that the link never reaches.
    """
    done = Path("/")
    pending = list(path.parts[1:])
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            done = done.parent
            continue
        candidate = done / part
        if not candidate.is_symlink():
            done = candidate
            continue
        hops -= 1
        if hops < 0:
            return None
        target = os.readlink(candidate)
        if target.startswith("/"):
            done = Path("/")
        pending[:0] = [p for p in target.split("/") if p]
    return done


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(_ENTRY, min_size=1, max_size=10), rootfs=st.booleans())
@example(entries=[("symlink", "a", "a//a")], rootfs=False)  # CI found it: a loop
def test_any_mix_of_names_and_links_stays_beneath(
    entries: list[tuple[str, str, str]], rootfs: bool
) -> None:
    builders = {
        "file": lambda n, t: file(n, b"evil"),
        "dir": lambda n, t: directory(n),
        "symlink": symlink,
        "hardlink": hardlink,
    }
    data = archive(*(builders[kind](name, target) for kind, name, target in entries))
    base = Path(tempfile.mkdtemp(prefix="forkd-fuzz-"))
    try:
        dest = base / "dest"
        dest.mkdir()
        (base / "outside").mkdir()
        (base / "outside" / "a").write_text("untouched")
        with contextlib.suppress(ArchiveError):
            extract(io.BytesIO(data).read, dest, ROOTFS if rootfs else DATA, LIMITS)
        assert sorted(p.name for p in base.iterdir()) == ["dest", "outside"]
        assert [p.name for p in (base / "outside").iterdir()] == ["a"]
        assert (base / "outside" / "a").read_text() == "untouched"
        if not rootfs:  # every link the data policy kept resolves inside
            _links_lead_inside(dest)
    finally:
        shutil.rmtree(base)


def _links_lead_inside(dest: Path) -> None:
    for path in dest.rglob("*"):
        if path.is_symlink():
            real = _resolve(path)
            if real is None:  # a loop: it reaches nothing, inside or out
                continue
            assert real == dest.resolve() or dest.resolve() in real.parents, path


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=st.lists(st.lists(_ENTRY, min_size=1, max_size=6), min_size=2, max_size=3))
@example(
    runs=[[("dir", "a/b", ""), ("symlink", "l", "a/b/../../outside")], [("symlink", "a/b", "..")]]
)
def test_archives_unpacked_one_after_another_leave_no_link_leading_out(
    runs: list[list[tuple[str, str, str]]],
) -> None:
    """``forkd cp`` into a directory an earlier copy filled: each archive is judged
    alone, and a later one must not turn an earlier link that led inside outward."""
    builders = {
        "file": lambda n, t: file(n, b"evil"),
        "dir": lambda n, t: directory(n),
        "symlink": symlink,
        "hardlink": hardlink,
    }
    base = Path(tempfile.mkdtemp(prefix="forkd-fuzz-"))
    try:
        dest = base / "dest"
        dest.mkdir()
        for entries in runs:
            data = archive(*(builders[kind](name, target) for kind, name, target in entries))
            with contextlib.suppress(ArchiveError):
                extract(io.BytesIO(data).read, dest, DATA, LIMITS)
        _links_lead_inside(dest)
    finally:
        shutil.rmtree(base)


def test_a_link_loop_is_judged_a_loop_not_an_escape(tmp_path: Path) -> None:
    """The CI case ``a -> a//a``: realpath says ``/a``; the link leads nowhere."""
    (tmp_path / "a").symlink_to("a//a")
    (tmp_path / "in").symlink_to("sub/../a/../x")
    assert _resolve(tmp_path / "a") is None
    assert _resolve(tmp_path / "in") is None  # passes through the loop
    (tmp_path / "ok").symlink_to("x/../y")
    assert _resolve(tmp_path / "ok") == tmp_path / "y"
