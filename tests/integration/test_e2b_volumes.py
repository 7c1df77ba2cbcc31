"""E2B's volumes through E2B's own SDK against the real daemon: two sandboxes mount one
volume and see each other's writes at once; a snapshot's sandboxes and a woken one mount
it again; a full volume is the volume's problem, not the host's; a mounted volume cannot
be destroyed, and a destroyed one leaves nothing on the host."""

from __future__ import annotations

import os
from pathlib import Path

import e2b
import pytest

from .conftest import Daemon

pytestmark = pytest.mark.integration


def volume_home(daemon: Daemon, volume_id: str) -> Path:
    return daemon.state_dir / "shared-volumes" / volume_id


def test_two_sandboxes_share_a_volume(e2b_env: str, daemon: Daemon) -> None:
    vol = e2b.Volume.create("it-shared")
    home = volume_home(daemon, vol.volume_id)
    assert os.path.ismount(home / "data")  # its own filesystem
    a = e2b.Sandbox.create(e2b_env, timeout=300, volume_mounts={"/mnt/team": vol})
    b = e2b.Sandbox.create(e2b_env, timeout=300, volume_mounts={"/data": "it-shared"})
    try:
        a.commands.run("mkdir -p /mnt/team/notes && echo from-a > /mnt/team/notes/a.txt")
        assert b.files.read("/data/notes/a.txt") == "from-a\n"  # at once: no cache
        b.files.write("/data/notes/b.txt", "from-b")
        assert a.commands.run("cat /mnt/team/notes/b.txt").stdout == "from-b"
        assert (home / "data" / "notes" / "b.txt").read_text() == "from-b"
        # What is not on the volume is each sandbox's own.
        a.commands.run("echo mine > /tmp/own.txt")
        assert not b.files.exists("/tmp/own.txt")

        # A full volume: the writer gets ENOSPC, the host's disk is untouched.
        full = a.commands.run(
            "dd if=/dev/zero of=/mnt/team/big bs=1M count=80 2>&1; echo rc=$?", timeout=120
        )
        assert "No space left on device" in full.stdout, full.stdout
        assert (home / "disk.img").stat().st_blocks * 512 <= 49 << 20
        a.commands.run("rm /mnt/team/big")

        with pytest.raises(e2b.VolumeException, match="mounted by"):
            e2b.Volume.destroy(vol.volume_id)

        # A snapshot's sandboxes mount the volume too, and see it as it is now.
        a.create_snapshot(name="it-with-volume")
        b.files.write("/data/notes/later.txt", "after the snapshot")
        c = e2b.Sandbox.create("it-with-volume", timeout=300)
        try:
            assert c.files.read("/mnt/team/notes/later.txt") == "after the snapshot"
            c.files.write("/mnt/team/notes/c.txt", "from-c")
            assert b.files.read("/data/notes/c.txt") == "from-c"
        finally:
            c.kill()
            e2b.Sandbox.delete_snapshot("it-with-volume")

        # Paused (hibernated) and resumed: its mount comes back.
        a.pause()
        b.files.write("/data/notes/while-paused.txt", "zzz")
        a.connect()
        assert a.commands.run("cat /mnt/team/notes/while-paused.txt").stdout == "zzz"
    finally:
        a.kill()
        b.kill()
    assert e2b.Volume.destroy(vol.volume_id) is True
    assert not home.exists()
    assert vol.volume_id not in Path("/proc/mounts").read_text()
