"""tar2sqfs as a uid of its own: a root daemon's squashfs writer (C code reading names and
attributes an image chose) holds no root, no group and no capability, can write only the
directory it was given, and the image it made is handed back to the daemon."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.errors import ImageError
from forkd.image_import.squash import build_rootfs
from tests.archive.hostile import directory, file
from tests.unit.test_image_layers import Image

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root"),
    pytest.mark.skipif(
        shutil.which("tar2sqfs") is None,
        reason="tar2sqfs (squashfs-tools-ng) is missing: ./dev.sh installs it",
    ),
]
JAIL = (64999, 64998)  # no user of this host has them: nothing else is theirs

# Stands in for tar2sqfs: says who it runs as (and what it could reach) in its output,
# the last argument, then tries to write where the jail's uid may not.
PROBE = """#!/bin/sh
out="$(eval echo \\${$#})"
cat >/dev/null
{ id -u; id -g; id -G; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status
  touch "$FORBIDDEN" 2>/dev/null && echo wrote-outside || echo kept-in; } >"$out"
"""


def test_the_real_tar2sqfs_as_another_uid_makes_an_image_the_daemon_owns(tmp_path: Path) -> None:
    image = Image(tmp_path)
    image.layer(directory("etc"), file("etc/os", b"jailed"))
    stats = build_rootfs(image.layers, image.out, image.work, run_as=JAIL)
    assert image.cat("/etc/os") == b"jailed" and stats.entries == 2
    st = image.out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (os.getuid(), os.getgid(), 0o644)


@pytest.fixture
def public() -> Iterator[Path]:
    """A root-owned directory anyone may enter and read, none but root write."""
    d = Path(tempfile.mkdtemp(prefix="forkd-jail-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def fake_tool(directory: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``script`` as the tar2sqfs on PATH, readable by the jail's uid."""
    (directory / "tar2sqfs").write_text(script)
    (directory / "tar2sqfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}:{os.environ['PATH']}")


def test_the_writer_holds_no_root_group_or_capability_and_writes_only_its_jail(
    tmp_path: Path, public: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_tool(public, PROBE, monkeypatch)
    forbidden = public / "not-the-jails"
    monkeypatch.setenv("FORBIDDEN", str(forbidden))
    image = Image(tmp_path)
    image.layer(file("a", b"x"))
    build_rootfs(image.layers, image.out, image.work, run_as=JAIL)
    said = image.out.read_text().splitlines()
    assert said[:3] == [str(JAIL[0]), str(JAIL[1]), str(JAIL[1])]  # no supplementary group
    status = dict(line.split(":\t") for line in said[3:6])
    assert status == {"CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1"}
    assert said[6] == "kept-in" and not forbidden.exists()


def test_a_writer_that_leaves_no_file_fails_and_nothing_lands(
    tmp_path: Path, public: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = '#!/bin/sh\ncat >/dev/null\nout="$(eval echo \\${$#})"\nmkdir "$out"\n'
    fake_tool(public, script, monkeypatch)
    image = Image(tmp_path)
    image.layer(file("a", b"x"))
    with pytest.raises((ImageError, OSError)):
        build_rootfs(image.layers, image.out, image.work, run_as=JAIL)
    assert not image.out.exists()
