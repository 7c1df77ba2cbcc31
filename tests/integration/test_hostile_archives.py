"""A guest that answers a directory download with a hostile tar, in a real sandbox.

Code in the sandbox replaces its own agent's tar writer (``eval`` runs inside the
agent process, as root in the guest could by patching the file and having init
respawn it): every later directory download then streams whatever archive the
guest chose. ``forkd cp``, the SDK and the async SDK each unpack it on this host
with forkd's one extractor, which must refuse it and write nothing outside the
destination.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from forkd.archive import ArchiveError
from forkd.client import AsyncController, AsyncSandbox, Sandbox
from tests.archive.hostile import archive, file, hardlink, path_max_chain, symlink

from .conftest import Daemon

pytestmark = pytest.mark.integration

# In the agent, by eval: a directory download now sends /tmp/hostile.tar as it is.
PATCH_TAR_WRITER = """
import forkd_files

def _hostile_tar(pipe, path):
    with open("/tmp/hostile.tar", "rb") as f:
        pipe.write(f.read())

forkd_files.write_tar = _hostile_tar
True
"""


def _escape_by_name(outside: Path) -> bytes:
    return archive(file("ok.txt", b"fine"), file("../escaped", b"evil"))


def _escape_by_symlink(outside: Path) -> bytes:
    return archive(symlink("out", str(outside)), file("out/victim", b"evil"))


def _overwrite_by_hard_link(outside: Path) -> bytes:
    return archive(hardlink("h", "../outside/victim"), file("h", b"evil"))


def _path_max_chain(outside: Path) -> bytes:
    return archive(*path_max_chain(str(outside)))


CASES: dict[str, Callable[[Path], bytes]] = {
    "dotdot": _escape_by_name,
    "symlink": _escape_by_symlink,
    "hardlink": _overwrite_by_hard_link,
    "path-max-chain": _path_max_chain,
}


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every name under ``root`` outside ``dest*`` with its kind and content."""
    seen = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.startswith(("dest", "sdk", "async")):
            continue
        st = path.lstat()
        body = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        seen[rel] = (stat.S_IFMT(st.st_mode), body)
    return seen


@pytest.fixture
def hostile(sb: Sandbox) -> Callable[[bytes], None]:
    def serve(data: bytes) -> None:
        sb.files.write("/tmp/hostile.tar", data)
        assert sb.commands.run(["mkdir", "-p", "/work/x"]).exit_code == 0
        assert sb.eval(PATCH_TAR_WRITER).result == "True"

    return serve


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_guest_writes_nothing_outside_a_download(
    daemon: Daemon,
    sb: Sandbox,
    hostile: Callable[[bytes], None],
    tmp_path: Path,
    case: str,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("original")
    hostile(CASES[case](outside))
    before = _snapshot(tmp_path)

    # forkd cp ID:/work/x ./dest/
    (tmp_path / "dest").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "forkd.cli", "cp", f"{sb.id}:/work/x", f"{tmp_path / 'dest'}/"],
        capture_output=True,
        text=True,
        timeout=120,
        env=daemon.env(),
        cwd=tmp_path,
    )
    assert r.returncode != 0, r.stdout
    assert "refusing" in r.stderr or "not a directory" in r.stderr, r.stderr
    assert str(tmp_path) not in r.stderr.replace(str(tmp_path / "dest"), "")

    # The SDK's download of a directory: refused, nothing made (staged beside it).
    with pytest.raises(ArchiveError):
        sb.files.download("/work/x", tmp_path / "sdk", directory=True)
    assert not (tmp_path / "sdk").exists()

    async def download_async() -> None:
        async with AsyncController(daemon.url, token=daemon.token) as ctl:
            asb = await AsyncSandbox.connect(sb.id, controller=ctl)
            await asb.files.download("/work/x", tmp_path / "async", directory=True)

    with pytest.raises(ArchiveError):
        asyncio.run(download_async())
    assert not (tmp_path / "async").exists()

    assert (outside / "victim").read_text() == "original"
    assert _snapshot(tmp_path) == before
    leftovers = [p for p in tmp_path.iterdir() if "forkd-partial" in p.name]
    assert leftovers == []
    assert not os.path.lexists(tmp_path / "escaped")
